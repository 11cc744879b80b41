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
#include <stdlib.h>

#include "cpu_kernels.h"

#include "cpu_simd.h"

typedef struct {
    float *states, *scratch, *y;
    const int64_t *src, *dst;
    const float *x, *dt, *A, *D, *B, *C;
    int64_t sxb, sxt, sxh, sdb, sdt, sBb, sBt, sBg, sCb, sCt, sCg;
    int64_t batch, T, nheads, headdim, d_state, ngroups;
} mamba2_job;

/* the recurrence of (row, head) units u0 <= u < u1 (u = b · nheads + h), h_t in `scratch` (one head) */
static void mamba2_units(const mamba2_job *j, int64_t u0, int64_t u1, float *scratch) {
    const int64_t T = j->T, nheads = j->nheads, headdim = j->headdim, d_state = j->d_state;
    const int64_t head_size = headdim * d_state, slot_size = nheads * head_size;
    const int64_t heads_per_group = nheads / j->ngroups, vec_end = d_state / 8 * 8;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / nheads, h = u % nheads, g = h / heads_per_group;
        const float *prev = j->states + j->src[b] * slot_size + h * head_size;
        for (int64_t t = 0; t < T; ++t) {
            const int64_t slot = j->dst[b * T + t];
            float *snap = slot >= 0 ? j->states + slot * slot_size + h * head_size : 0;
            const int stream = snap && ((uintptr_t)snap & 31) == 0 && d_state % 8 == 0;
            const float dtv = j->dt[b * j->sdb + t * j->sdt + h];
            const float decay = expf(dtv * j->A[h]);
            const __m256 decay8 = _mm256_set1_ps(decay);
            const float *xv = j->x + b * j->sxb + t * j->sxt + h * j->sxh;
            const float *Bv = j->B + b * j->sBb + t * j->sBt + g * j->sBg;
            const float *Cv = j->C + b * j->sCb + t * j->sCt + g * j->sCg;
            float *yv = j->y + ((b * T + t) * nheads + h) * headdim;
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
                yv[p] = fmaf(j->D[h], xv[p], hsum8(acc) + tail);
            }
            prev = scratch;
        }
    }
    _mm_sfence(); /* this thread's streamed snapshots are visible before its part counts as done */
}

/* With more than one thread the (row, head) units split into contiguous
 * ranges, one per thread (cpu_pool.c): each unit is the same loop on any
 * thread, so the bits do not change. Parts past the first keep h_t in the
 * thread's own head of scratch. */
#define PARALLEL_MIN_FLOATS (1 << 16) /* state floats updated (units · T · head) below which one thread runs */
static _Thread_local float *own;
static _Thread_local size_t own_floats;

static void mamba2_part(void *ctx, int part, int parts) {
    const mamba2_job *j = ctx;
    const int64_t units = j->batch * j->nheads, head_size = j->headdim * j->d_state;
    float *scratch = j->scratch;
    if (part > 0) {
        if (own_floats < (size_t)head_size) {
            free(own);
            own_floats = 0;
            if (posix_memalign((void **)&own, 64, (size_t)head_size * sizeof(float))) own = 0;
            else own_floats = (size_t)head_size;
        }
        if (!own) { /* no heap: one head on the stack (32 KiB for Bamba's 64 × 128) */
            float head[head_size];
            mamba2_units(j, units * part / parts, units * (part + 1) / parts, head);
            return;
        }
        scratch = own;
    }
    mamba2_units(j, units * part / parts, units * (part + 1) / parts, scratch);
}

int hs_mamba2_steps(float *states, const int64_t *src, const int64_t *dst, float *scratch,
                    const float *x, int64_t sxb, int64_t sxt, int64_t sxh,
                    const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *D,
                    const float *B, int64_t sBb, int64_t sBt, int64_t sBg,
                    const float *C, int64_t sCb, int64_t sCt, int64_t sCg,
                    float *y, int64_t batch, int64_t T, int64_t nheads, int64_t headdim, int64_t d_state,
                    int64_t ngroups) {
    if (batch < 0 || T < 1 || nheads < 1 || headdim < 1 || d_state < 1 || ngroups < 1 || nheads % ngroups) return -1;
    mamba2_job job = {states, scratch, y, src, dst, x, dt, A, D, B, C, sxb, sxt, sxh, sdb, sdt, sBb, sBt, sBg,
                      sCb, sCt, sCg, batch, T, nheads, headdim, d_state, ngroups};
    const int64_t units = batch * nheads;
    const int threads = hs_threads(), parts = threads < units ? threads : (int)units;
    if (parts > 1 && units * T * headdim * d_state >= PARALLEL_MIN_FLOATS && hs_parallel(mamba2_part, &job, parts))
        return 0;
    mamba2_units(&job, 0, units, scratch);
    return 0;
}
