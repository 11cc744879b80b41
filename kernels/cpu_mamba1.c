/* The Mamba-1 recurrence over T inputs on x86 CPUs (AVX2 + FMA), straight
 * into the ring slots: the CPU counterpart of the Triton `mamba1_verify`.
 *
 * For each row b and channel c, from the state row in slot src[b], for
 * t = 0 … T - 1:
 *     h_t = exp(Δ_t,c A_c) ⊙ h_{t-1} + (Δ_t,c x_t,c) B_t      [d_state]
 *     y_t,c = h_t · C_t + D_c x_t,c
 * h_t goes into slot dst[b·T + t] when that is ≥ 0. A channel's state row
 * (d_state floats, 16 in most models) stays in registers across the inputs;
 * memory sees the source state once and each snapshot once (exp: `exp8`).
 *
 * states: [num_slots, d_inner, d_state] contiguous; x, dt: [batch, T,
 * d_inner] with unit channel stride (row and time strides passed); A:
 * [d_inner, d_state] contiguous; B, C: [batch, T, d_state] with unit inner
 * stride; D: [d_inner]; y: [batch, T, d_inner] contiguous. Every row runs
 * all T inputs. Built by `cpu_native.py`, used through `cpu_mamba1.py`.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_simd.h"

#define MAX_STATE 64

int hs_mamba1_steps(float *states, const int64_t *src, const int64_t *dst,
                    const float *x, int64_t sxb, int64_t sxt, const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *B, int64_t sBb, int64_t sBt, const float *C, int64_t sCb,
                    int64_t sCt, const float *D, float *y, int64_t batch, int64_t T, int64_t d_inner,
                    int64_t d_state) {
    if (batch < 0 || T < 1 || d_inner < 1 || d_state < 8 || d_state % 8 || d_state > MAX_STATE) return -1;
    const int64_t nv = d_state / 8, slot_size = d_inner * d_state;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t c = 0; c < d_inner; ++c) {
            __m256 h[MAX_STATE / 8], a[MAX_STATE / 8];
            const float *h0 = states + src[b] * slot_size + c * d_state;
            for (int64_t v = 0; v < nv; ++v) {
                h[v] = _mm256_loadu_ps(h0 + 8 * v);
                a[v] = _mm256_loadu_ps(A + c * d_state + 8 * v);
            }
            for (int64_t t = 0; t < T; ++t) {
                const float dtv = dt[b * sdb + t * sdt + c], xv = x[b * sxb + t * sxt + c];
                const __m256 dt8 = _mm256_set1_ps(dtv), dtx8 = _mm256_set1_ps(dtv * xv);
                const float *Bt = B + b * sBb + t * sBt, *Ct = C + b * sCb + t * sCt;
                __m256 acc = _mm256_setzero_ps();
                for (int64_t v = 0; v < nv; ++v) {
                    __m256 inject = _mm256_mul_ps(dtx8, _mm256_loadu_ps(Bt + 8 * v));
                    h[v] = _mm256_fmadd_ps(exp8(_mm256_mul_ps(dt8, a[v])), h[v], inject);
                    acc = _mm256_fmadd_ps(h[v], _mm256_loadu_ps(Ct + 8 * v), acc);
                }
                y[(b * T + t) * d_inner + c] = fmaf(D[c], xv, hsum8(acc));
                const int64_t slot = dst[b * T + t];
                if (slot >= 0) {
                    float *snap = states + slot * slot_size + c * d_state;
                    if (((uintptr_t)snap & 31) == 0)  /* streaming stores: the slot's lines are not read first */
                        for (int64_t v = 0; v < nv; ++v) _mm256_stream_ps(snap + 8 * v, h[v]);
                    else
                        for (int64_t v = 0; v < nv; ++v) _mm256_storeu_ps(snap + 8 * v, h[v]);
                }
            }
        }
    }
    _mm_sfence(); /* the streamed snapshots are visible before the call returns */
    return 0;
}
