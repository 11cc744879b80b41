/* The Mamba-1 recurrence over T inputs on x86 CPUs (AVX2 + FMA, AVX-512 where present), straight
 * into the ring slots: the CPU counterpart of the Triton `mamba1_verify`.
 *
 * For each row b and channel c, from the state row in slot src[b], for
 * t = 0 … T - 1:
 *     h_t = exp(Δ_t,c A_c) ⊙ h_{t-1} + (Δ_t,c x_t,c) B_t      [d_state]
 *     y_t,c = h_t · C_t + D_c x_t,c
 * h_t goes into slot dst[b·T + t] when that is ≥ 0. A channel's state row
 * (d_state floats, 16 in most models) stays in registers across the inputs;
 * memory sees the source state once and each snapshot once (exp: `exp8`).
 * Where the products run on AVX-512 (`hs_rows_isa`) two channels at a time
 * take 16-lane vectors with the same bits (`two_channels512`), which take
 * less time than the AVX2 loop, most for a decode step's few inputs.
 *
 * states: [num_slots, d_inner, d_state] contiguous; x, dt: [batch, T,
 * d_inner] with unit channel stride (row and time strides passed); A:
 * [d_inner, d_state] contiguous; B, C: [batch, T, d_state] with unit inner
 * stride; D: [d_inner]; y: [batch, T, d_inner] contiguous. Every row runs
 * all T inputs. Built by `cpu/native.py`, used through `cpu/mamba1.py`.
 *
 * With more than one thread a row's channel pairs split over the threads
 * (`mamba1_part`); the bits do not change.
 *
 * Over a tree (`parents`, cpu/kernels.h) input t starts from its parent's
 * state: the registers where the parent is t - 1, else the head slot or the
 * parent's snapshot slot (written earlier by the same loop, so no streaming
 * stores there); each step is the chain's, so an input gets the bits it gets
 * in the chain along its path.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

#define MAX_STATE 64

/* hs_mamba1_steps' arguments, for the loops it hands a row's channels to */
typedef struct {
    float *states, *y;
    const int64_t *src, *dst, *parents;
    const float *x, *dt, *A, *B, *C, *D;
    int64_t sxb, sxt, sdb, sdt, sBb, sBt, sCb, sCt;
    int64_t batch, T, d_inner, d_state;
} mamba1_job;

/* the slot of row b's state before an input whose parent is `parent` (-1: the head) */
static inline int64_t parent_slot(const mamba1_job *j, int64_t b, int64_t parent) {
    return parent < 0 ? j->src[b] : j->dst[b * j->T + parent];
}

/* Channels c0 and c0 + 1 of row b on AVX-512 (d_state a multiple of 16): the state row in 16-lane
 * vectors, exp16 for exp8, y's sums the AVX2 loop's 8-lane chains (each vector's low then high
 * half), so every value is the AVX2 loop's, bit for bit; two channels at a time, their chains
 * through the inputs interleaved (one channel's exp would otherwise set the pace). */
TARGET512 static void two_channels512(const mamba1_job *j, int64_t b, int64_t c0) {
    float *states = j->states, *y = j->y;
    const int64_t *src = j->src, *dst = j->dst;
    const float *x = j->x, *dt = j->dt, *A = j->A, *B = j->B, *C = j->C, *D = j->D;
    const int64_t sxb = j->sxb, sxt = j->sxt, sdb = j->sdb, sdt = j->sdt, sBb = j->sBb, sBt = j->sBt;
    const int64_t sCb = j->sCb, sCt = j->sCt, T = j->T, d_inner = j->d_inner, d_state = j->d_state;
    const int64_t nv = d_state / 16, slot_size = d_inner * d_state;
    v16 h[2][MAX_STATE / 16], a[2][MAX_STATE / 16];
    for (int k = 0; k < 2; ++k)
        for (int64_t v = 0; v < nv; ++v) {
            h[k][v] = v16_load(states + src[b] * slot_size + (c0 + k) * d_state + 16 * v);
            a[k][v] = v16_load(A + (c0 + k) * d_state + 16 * v);
        }
    for (int64_t t = 0; t < T; ++t) {
        const float *Bt = B + b * sBb + t * sBt, *Ct = C + b * sCb + t * sCt;
        const int64_t slot = dst[b * T + t], parent = j->parents ? j->parents[b * T + t] : t - 1;
        if (parent != t - 1)  /* a tree's: the head's or an earlier input's snapshot */
            for (int k = 0; k < 2; ++k)
                for (int64_t v = 0; v < nv; ++v)
                    h[k][v] = v16_load(states + parent_slot(j, b, parent) * slot_size + (c0 + k) * d_state + 16 * v);
        for (int k = 0; k < 2; ++k) {
            const int64_t c = c0 + k;
            const float dtv = dt[b * sdb + t * sdt + c], xv = x[b * sxb + t * sxt + c];
            const v16 dt16 = v16_set1(dtv), dtx16 = v16_set1(dtv * xv);
            v8 acc = v8_zero();
            for (int64_t v = 0; v < nv; ++v) {
                const v16 inject = v16_mul(dtx16, v16_load(Bt + 16 * v));
                h[k][v] = v16_fmadd(exp16(v16_mul(dt16, a[k][v])), h[k][v], inject);
                const v8 hi = v16_hi(h[k][v]);
                acc = v8_fmadd(v16_lo(h[k][v]), v8_load(Ct + 16 * v), acc);
                acc = v8_fmadd(hi, v8_load(Ct + 16 * v + 8), acc);
            }
            y[(b * T + t) * d_inner + c] = fmaf(D[c], xv, hsum8(acc));
            if (slot >= 0) {
                float *snap = states + slot * slot_size + c * d_state;
                if (!j->parents && ((uintptr_t)snap & 63) == 0)  /* streaming: the slot's lines are not read first */
                    for (int64_t v = 0; v < nv; ++v) v16_stream(snap + 16 * v, h[k][v]);
                else
                    for (int64_t v = 0; v < nv; ++v) v16_store(snap + 16 * v, h[k][v]);
            }
        }
    }
}

/* Channel c of row b on AVX2: the state row in 8-lane vectors */
static void one_channel(const mamba1_job *j, int64_t b, int64_t c) {
    float *states = j->states, *y = j->y;
    const int64_t *parents = j->parents, T = j->T, d_inner = j->d_inner, d_state = j->d_state;
    const int64_t nv = d_state / 8, slot_size = d_inner * d_state;
    v8 h[MAX_STATE / 8], a[MAX_STATE / 8];
    const float *h0 = states + j->src[b] * slot_size + c * d_state;
    for (int64_t v = 0; v < nv; ++v) {
        h[v] = v8_load(h0 + 8 * v);
        a[v] = v8_load(j->A + c * d_state + 8 * v);
    }
    for (int64_t t = 0; t < T; ++t) {
        const int64_t parent = parents ? parents[b * T + t] : t - 1;
        if (parent != t - 1)  /* a tree's: the head's or an earlier input's snapshot */
            for (int64_t v = 0; v < nv; ++v)
                h[v] = v8_load(states + parent_slot(j, b, parent) * slot_size + c * d_state + 8 * v);
        const float dtv = j->dt[b * j->sdb + t * j->sdt + c], xv = j->x[b * j->sxb + t * j->sxt + c];
        const v8 dt8 = v8_set1(dtv), dtx8 = v8_set1(dtv * xv);
        const float *Bt = j->B + b * j->sBb + t * j->sBt, *Ct = j->C + b * j->sCb + t * j->sCt;
        v8 acc = v8_zero();
        for (int64_t v = 0; v < nv; ++v) {
            v8 inject = v8_mul(dtx8, v8_load(Bt + 8 * v));
            h[v] = v8_fmadd(exp8(v8_mul(dt8, a[v])), h[v], inject);
            acc = v8_fmadd(h[v], v8_load(Ct + 8 * v), acc);
        }
        y[(b * T + t) * d_inner + c] = fmaf(j->D[c], xv, hsum8(acc));
        const int64_t slot = j->dst[b * T + t];
        if (slot >= 0) {
            float *snap = states + slot * slot_size + c * d_state;
            if (!parents && ((uintptr_t)snap & 31) == 0)  /* streaming: the slot's lines are not read first */
                for (int64_t v = 0; v < nv; ++v) v8_stream(snap + 8 * v, h[v]);
            else
                for (int64_t v = 0; v < nv; ++v) v8_store(snap + 8 * v, h[v]);
        }
    }
}

/* units u0 <= u < u1, unit u = b · pairs + p: channels 2p and 2p + 1 (the last alone where d_inner is odd)
 * of row b, together on AVX-512, else one at a time (the same bits) */
static void mamba1_units(const mamba1_job *j, int64_t u0, int64_t u1) {
    const int64_t pairs = (j->d_inner + 1) / 2;
    const int wide = j->d_state % 16 == 0 && hs_rows_isa(-1) == 1;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / pairs, c = u % pairs * 2;
        if (wide && c + 2 <= j->d_inner) {
            two_channels512(j, b, c);
            continue;
        }
        for (int64_t k = c; k < c + 2 && k < j->d_inner; ++k) one_channel(j, b, k);
    }
    stream_fence(); /* this thread's streamed snapshots are visible before its part counts as done */
}

/* With more than one thread the units (a row's channel pairs) split into contiguous ranges
 * (`hs_parallel_units`, cpu/pool.c): each unit is the same loop on any thread, so the bits do not
 * change. */
#define PARALLEL_MIN_FLOATS (1 << 16) /* state floats updated (units · T · 2 · d_state) below which one thread runs */

static void mamba1_part(void *ctx, int part, int parts) {
    const mamba1_job *j = ctx;
    const int64_t units = j->batch * ((j->d_inner + 1) / 2);
    mamba1_units(j, units * part / parts, units * (part + 1) / parts);
}

int hs_mamba1_steps(float *states, const int64_t *src, const int64_t *dst,
                    const float *x, int64_t sxb, int64_t sxt, const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *B, int64_t sBb, int64_t sBt, const float *C, int64_t sCb,
                    int64_t sCt, const float *D, float *y, int64_t batch, int64_t T, int64_t d_inner,
                    int64_t d_state, const int64_t *parents) {
    if (batch < 0 || T < 1 || d_inner < 1 || d_state < 8 || d_state % 8 || d_state > MAX_STATE
        || !hs_parents_ok(parents, dst, batch, T))
        return -1;
    const mamba1_job job = {states, y, src, dst, parents, x, dt, A, B, C, D, sxb, sxt, sdb, sdt, sBb, sBt, sCb, sCt,
                            batch, T, d_inner, d_state};
    const int64_t units = batch * ((d_inner + 1) / 2);
    if (hs_parallel_units(mamba1_part, (void *)&job, units, units * T * 2 * d_state, PARALLEL_MIN_FLOATS)) return 0;
    mamba1_units(&job, 0, units);
    return 0;
}
