/* The Mamba-2 recurrence over T inputs on x86 CPUs (AVX2 + FMA), straight
 * into the ring slots: the CPU counterpart of the Triton `mamba2_verify`.
 *
 * For each row b and head h (group g = h / (nheads / ngroups)), from the
 * state in slot src[b], for t = 0 … T - 1:
 *     h_t = exp(Δ_t A_h) · h_{t-1} + (Δ_t x_t) ⊗ B_t        [headdim, d_state]
 *     y_t = h_t · C_t + D_h x_t                              [headdim]
 * h_t is computed into a scratch head, read from there by step t + 1, and
 * copied to slot dst[b·T + t] (its snapshot) when that is ≥ 0 with streaming
 * stores, which skip reading the slot's lines first: one head's state (16 KiB
 * for 64 × 64) stays in L1 across the steps, and the only memory traffic is
 * reading the source state and writing the snapshots once.
 * Built and loaded by `cpu_native.py`; used through `cpu_mamba2.py`.
 *
 * states: [num_slots, nheads, headdim, d_state] contiguous. x: [batch, T,
 * nheads, headdim], dt: [batch, T, nheads], B, C: [batch, T, ngroups,
 * d_state], each with unit innermost stride (the other strides passed). y:
 * [batch, T, nheads, headdim] contiguous. Every row runs all T inputs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

#include "cpu_simd.h"

int hs_mamba2_steps(float *states, const int64_t *src, const int64_t *dst, float *scratch,
                    const float *x, int64_t sxb, int64_t sxt, int64_t sxh,
                    const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *D,
                    const float *B, int64_t sBb, int64_t sBt, int64_t sBg,
                    const float *C, int64_t sCb, int64_t sCt, int64_t sCg,
                    float *y, int64_t batch, int64_t T, int64_t nheads, int64_t headdim, int64_t d_state,
                    int64_t ngroups) {
    if (batch < 0 || T < 1 || nheads < 1 || headdim < 1 || d_state < 1 || ngroups < 1 || nheads % ngroups) return -1;
    const int64_t head_size = headdim * d_state, slot_size = nheads * head_size;
    const int64_t heads_per_group = nheads / ngroups, vec_end = d_state / 8 * 8;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < nheads; ++h) {
            const int64_t g = h / heads_per_group;
            const float *prev = states + src[b] * slot_size + h * head_size;
            for (int64_t t = 0; t < T; ++t) {
                const int64_t slot = dst[b * T + t];
                float *snap = slot >= 0 ? states + slot * slot_size + h * head_size : 0;
                const int stream = snap && ((uintptr_t)snap & 31) == 0 && d_state % 8 == 0;
                const float dtv = dt[b * sdb + t * sdt + h];
                const float decay = expf(dtv * A[h]);
                const __m256 decay8 = _mm256_set1_ps(decay);
                const float *xv = x + b * sxb + t * sxt + h * sxh;
                const float *Bv = B + b * sBb + t * sBt + g * sBg;
                const float *Cv = C + b * sCb + t * sCt + g * sCg;
                float *yv = y + ((b * T + t) * nheads + h) * headdim;
                for (int64_t p = 0; p < headdim; ++p) {
                    const float xdt = dtv * xv[p];
                    const __m256 xdt8 = _mm256_set1_ps(xdt);
                    const float *hp = prev + p * d_state;
                    float *op = scratch + p * d_state, *sp = snap ? snap + p * d_state : 0;
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t n = 0; n < vec_end; n += 8) {
                        __m256 inject = _mm256_mul_ps(xdt8, _mm256_loadu_ps(Bv + n));
                        __m256 next = _mm256_fmadd_ps(_mm256_loadu_ps(hp + n), decay8, inject);
                        _mm256_storeu_ps(op + n, next);
                        if (stream) _mm256_stream_ps(sp + n, next);
                        else if (sp) _mm256_storeu_ps(sp + n, next);
                        acc = _mm256_fmadd_ps(next, _mm256_loadu_ps(Cv + n), acc);
                    }
                    float tail = 0.0f;
                    for (int64_t n = vec_end; n < d_state; ++n) {
                        float next = fmaf(hp[n], decay, xdt * Bv[n]);
                        op[n] = next;
                        if (sp) sp[n] = next;
                        tail = fmaf(next, Cv[n], tail);
                    }
                    yv[p] = fmaf(D[h], xv[p], hsum8(acc) + tail);
                }
                prev = scratch;
            }
        }
    }
    _mm_sfence(); /* the streamed snapshots are visible before the call returns */
    return 0;
}
