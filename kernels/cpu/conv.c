/* The causal conv window of one forward on x86 CPUs, straight into the ring
 * slots: the CPU counterpart of the Triton `conv_window_update`.
 *
 * For each row b and channel c, from the window in slot src[b] (the last
 * d_conv - 1 inputs), for t = 0 … T - 1:
 *     out[b, t, c] = act(Σ_k w[c, k] · e_k + bias[c]),  e = (window, xs[b, t, c])
 * and the window after input t goes into slot dst[b·T + t] when that is ≥ 0
 * (a later input wins a slot named twice). act is SiLU (silu = 1) or none.
 * states: [num_slots, conv_dim, d_conv - 1] contiguous; xs: [batch, T,
 * conv_dim] with unit channel stride (row and time strides passed); weight:
 * [conv_dim, d_conv] contiguous; bias: [conv_dim] or NULL; out: [batch, T,
 * conv_dim] contiguous. Every row runs all T inputs. Built by `cpu/native.py`,
 * used through `cpu/conv.py`.
 *
 * Input by input, 8 channels at a time: each tap is a row of xs (or of the
 * window, transposed once per row), read in memory order, so a prefill of
 * hundreds of inputs streams xs once instead of once per channel. Each
 * output is the fused multiply-add chain over the taps in order, then the
 * bias, then x / (1 + e^-x) with the vector exp (`exp8`) in every lane,
 * a channel past the last multiple of 8 included: an output's bits depend
 * only on its own inputs, whatever T, the batch or the channel count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#define MAX_CONV 16

/* act(Σ_k w_k e_k + bias) of 8 channels; w: [d_conv] vectors of the taps' weights */
static inline v8 conv8(const v8 *w, const v8 *e, v8 bias, int64_t d_conv, int64_t silu) {
    v8 s = v8_zero();
    for (int64_t k = 0; k < d_conv; ++k) s = v8_fmadd(w[k], e[k], s);
    s = v8_add(s, bias);
    if (silu) s = v8_div(s, v8_add(v8_set1(1.0f), exp8(v8_sub(v8_zero(), s))));
    return s;
}

int hs_conv_window_steps(float *states, const int64_t *src, const int64_t *dst,
                         const float *xs, int64_t sxb, int64_t sxt, const float *weight, const float *bias,
                         int64_t silu, float *out, int64_t batch, int64_t T, int64_t conv_dim, int64_t d_conv,
                         const int64_t *parents) {
    if (batch < 0 || T < 1 || conv_dim < 1 || d_conv < 2 || d_conv > MAX_CONV) return -1;
    for (int64_t r = 0; parents && r < batch * T; ++r)
        if (parents[r] < -1 || parents[r] >= r % T) return -1;
    const int64_t width = d_conv - 1, slot_size = conv_dim * width, full = conv_dim / 8 * 8;
    /* the window of a row transposed ([width, conv_dim]: tap times -width … -1), then the
     * weights tap-major ([d_conv, conv_dim]) */
    float *win = malloc(sizeof(float) * (size_t)(width + d_conv) * (size_t)conv_dim);
    if (!win) return -1;
    float *wt = win + width * conv_dim;
    for (int64_t c = 0; c < conv_dim; ++c)
        for (int64_t k = 0; k < d_conv; ++k) wt[k * conv_dim + c] = weight[c * d_conv + k];
    for (int64_t b = 0; b < batch; ++b) {
        const float *window = states + src[b] * slot_size, *xb = xs + b * sxb;
        for (int64_t c = 0; c < conv_dim; ++c)
            for (int64_t k = 0; k < width; ++k) win[k * conv_dim + c] = window[c * width + k];
        for (int64_t t = 0; t < T; ++t) {
            const float *tap[MAX_CONV];  /* tap k: the input at depth t - width + k on t's path */
            if (parents) {
                const int64_t *up = parents + b * T;
                int64_t depth = 0;
                for (int64_t at = t; up[at] >= 0; at = up[at]) ++depth;
                for (int64_t k = d_conv - 1, at = t; k >= 0; --k) {  /* from t up its ancestors */
                    const int64_t d = depth - width + k;
                    tap[k] = d < 0 ? win + (d + width) * conv_dim : xb + at * sxt;
                    if (d >= 0) at = up[at];
                }
            } else {
                for (int64_t k = 0; k < d_conv; ++k) {
                    const int64_t at = t - width + k;
                    tap[k] = at < 0 ? win + (at + width) * conv_dim : xb + at * sxt;
                }
            }
            float *o = out + (b * T + t) * conv_dim;
            v8 w[MAX_CONV], e[MAX_CONV];
            for (int64_t c = 0; c < full; c += 8) {
                for (int64_t k = 0; k < d_conv; ++k) {
                    w[k] = v8_load(wt + k * conv_dim + c);
                    e[k] = v8_load(tap[k] + c);
                }
                v8_store(o + c, conv8(w, e, bias ? v8_load(bias + c) : v8_zero(), d_conv, silu));
            }
            for (int64_t c = full; c < conv_dim; ++c) {  /* one channel in lane 0, the same operations */
                for (int64_t k = 0; k < d_conv; ++k) {
                    w[k] = v8_set1(wt[k * conv_dim + c]);
                    e[k] = v8_set1(tap[k][c]);
                }
                o[c] = v8_first(conv8(w, e, v8_set1(bias ? bias[c] : 0.0f), d_conv, silu));
            }
            const int64_t slot = dst[b * T + t];
            if (slot >= 0) {  /* the window after input t: inputs t - width + 1 … t */
                float *to = states + slot * slot_size;
                for (int64_t c = 0; c < conv_dim; ++c)
                    for (int64_t k = 0; k < width; ++k) to[c * width + k] = tap[k + 1][c];
            }
        }
    }
    free(win);
    return 0;
}
