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
 * conv_dim] contiguous. Every row runs all T inputs. Built by `cpu_native.py`,
 * used through `cpu_conv.py`.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define MAX_CONV 16

int hs_conv_window_steps(float *states, const int64_t *src, const int64_t *dst,
                         const float *xs, int64_t sxb, int64_t sxt, const float *weight, const float *bias,
                         int64_t silu, float *out, int64_t batch, int64_t T, int64_t conv_dim, int64_t d_conv) {
    if (batch < 0 || T < 1 || conv_dim < 1 || d_conv < 2 || d_conv > MAX_CONV) return -1;
    const int64_t width = d_conv - 1, slot_size = conv_dim * width;
    for (int64_t b = 0; b < batch; ++b) {
        const float *window = states + src[b] * slot_size;
        for (int64_t c = 0; c < conv_dim; ++c) {
            float e[MAX_CONV];
            const float *w = weight + c * d_conv;
            for (int64_t k = 0; k < width; ++k) e[k] = window[c * width + k];
            for (int64_t t = 0; t < T; ++t) {
                e[width] = xs[b * sxb + t * sxt + c];
                float s = 0.0f;
                for (int64_t k = 0; k < d_conv; ++k) s = fmaf(w[k], e[k], s);
                if (bias) s += bias[c];
                out[(b * T + t) * conv_dim + c] = silu ? s / (1.0f + expf(-s)) : s;
                for (int64_t k = 0; k < width; ++k) e[k] = e[k + 1];
                const int64_t slot = dst[b * T + t];
                if (slot >= 0)
                    for (int64_t k = 0; k < width; ++k) states[slot * slot_size + c * width + k] = e[k];
            }
        }
    }
    return 0;
}
