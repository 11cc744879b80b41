/* The Mamba-2 recurrence over T inputs on x86 CPUs (AVX2 + FMA, AVX-512 where present), straight
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
 * reading the source state and writing the snapshots once. Where the
 * products run on AVX-512 (`hs_rows_isa`) the update takes 16 columns per
 * vector with the same bits (`head_step512`): steps computed in L1 (5 inputs
 * with only the final state, a prefill's) run faster than on AVX2; a step
 * bound by its memory (a decode, a snapshot after every input) runs as fast.
 * Built and loaded by `cpu/native.py`; used through `cpu/mamba2.py`.
 *
 * states: [num_slots, nheads, headdim, d_state] contiguous. x: [batch, T,
 * nheads, headdim], dt: [batch, T, nheads], B, C: [batch, T, ngroups,
 * d_state], each with unit innermost stride (the other strides passed). y:
 * [batch, T, nheads, headdim] contiguous. Every row runs all T inputs.
 *
 * Over a tree (`parents`, `hs_tree`) input t starts from its parent's state: the head
 * slot's, the scratch head's where the parent is t - 1, else the parent's
 * snapshot slot (written earlier by the same thread, so no streaming stores
 * there); each step is the chain's, so an input gets the bits it gets in the
 * chain along its path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#include "simd.h"

typedef struct {
    float *states, *scratch, *y;
    const int64_t *src, *dst;
    const int64_t *parents;
    const float *x, *dt, *A, *D, *B, *C;
    int64_t sxb, sxt, sxh, sdb, sdt, sBb, sBt, sBg, sCb, sCt, sCg;
    int64_t batch, T, nheads, headdim, d_state, ngroups;
} mamba2_job;

/* One step of one head: h_t from `prev` into `out` (and `snap`, streamed where `stream`), y_t into
 * yv; x_t, B_t, C_t at xv, Bv, Cv, Δ_t, exp(Δ_t A_h) and D_h; the state [headdim, d_state]. */
typedef struct {
    const float *prev, *xv, *Bv, *Cv;
    float *out, *snap, *yv;
    float dtv, decay, Dh;
    int stream;
    int64_t headdim, d_state;
} head_input;

/* head_input's step, rows p0 <= p < p1 of the state. AVX2: 8 columns of d_state per vector. */
static void head_step(const head_input *in, int64_t p0, int64_t p1) {
    const float *prev = in->prev, *xv = in->xv, *Bv = in->Bv, *Cv = in->Cv;
    float *out = in->out, *snap = in->snap, *yv = in->yv;
    const float dtv = in->dtv, decay = in->decay, Dh = in->Dh;
    const int stream = in->stream;
    const int64_t d_state = in->d_state;
    const int64_t vec_end = d_state / 8 * 8;
    const v8 decay8 = v8_set1(decay);
    for (int64_t p = p0; p < p1; ++p) {
        const float xdt = dtv * xv[p];
        const v8 xdt8 = v8_set1(xdt);
        const float *hp = prev + p * d_state;
        float *op = out + p * d_state, *sp = snap ? snap + p * d_state : 0;
        v8 acc = v8_zero();
        for (int64_t n = 0; n < vec_end; n += 8) {
            v8 inject = v8_mul(xdt8, v8_load(Bv + n));
            v8 next = v8_fmadd(v8_load(hp + n), decay8, inject);
            v8_store(op + n, next);
            if (stream) v8_stream(sp + n, next);
            else if (sp) v8_store(sp + n, next);
            acc = v8_fmadd(next, v8_load(Cv + n), acc);
        }
        float tail = 0.0f;
        for (int64_t n = vec_end; n < d_state; ++n) {
            float next = fmaf(hp[n], decay, xdt * Bv[n]);
            op[n] = next;
            if (sp) sp[n] = next;
            tail = fmaf(next, Cv[n], tail);
        }
        yv[p] = fmaf(Dh, xv[p], hsum8(acc) + tail);
    }
}

/* The same step on AVX-512, R rows of the state at a time (d_state a multiple of 16, headdim of
 * 4). The state's update takes 16 columns per vector; y's sums stay 8-lane chains, each vector's
 * low then high half, so every lane adds the columns n, n + 8, n + 16, … in the AVX2 loop's
 * order: the same bits. R rows' chains interleave (one row's 2·d_state/16 dependent
 * multiply-adds would otherwise set the pace). */
TARGET512 static inline __attribute__((always_inline)) void head_rows512(const int R, const head_input *in) {
    const float *prev = in->prev, *xv = in->xv, *Bv = in->Bv, *Cv = in->Cv;
    float *out = in->out, *snap = in->snap, *yv = in->yv;
    const float dtv = in->dtv, decay = in->decay, Dh = in->Dh;
    const int stream = in->stream;
    const int64_t headdim = in->headdim, d_state = in->d_state;
    const v16 decay16 = v16_set1(decay);
    for (int64_t p = 0; p < headdim; p += R) {
        v16 xdt[4];
        v8 acc[4];
        for (int r = 0; r < R; ++r) {
            xdt[r] = v16_set1(dtv * xv[p + r]);
            acc[r] = v8_zero();
        }
        for (int64_t n = 0; n < d_state; n += 16) {
            const v16 Bn = v16_load(Bv + n);
            const v8 Clo = v8_load(Cv + n), Chi = v8_load(Cv + n + 8);
            for (int r = 0; r < R; ++r) {
                const int64_t at = (p + r) * d_state + n;
                const v16 next = v16_fmadd(v16_load(prev + at), decay16, v16_mul(xdt[r], Bn));
                v16_store(out + at, next);
                if (stream) v16_stream(snap + at, next);
                else if (snap) v16_store(snap + at, next);
                const v8 hi = v16_hi(next);
                acc[r] = v8_fmadd(v16_lo(next), Clo, acc[r]);
                acc[r] = v8_fmadd(hi, Chi, acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) yv[p + r] = fmaf(Dh, xv[p + r], hsum8(acc[r]));
    }
}

/* Four rows at a time where the step computes in L1 (h_{t-1} in scratch, no snapshot); two where
 * it reads the source state from memory or writes a snapshot, whose memory streams more rows at
 * once would multiply (four rows there make a decode step slower than AVX2; two make both kinds of
 * step faster) */
TARGET512 static void head_step512(const head_input *in, int in_cache) {
    if (in_cache && !in->snap) head_rows512(4, in);
    else head_rows512(2, in);
}

/* the recurrence of (row, head) units u0 <= u < u1 (u = b · nheads + h), h_t in `scratch` (one head) */
static void mamba2_units(const mamba2_job *j, int64_t u0, int64_t u1, float *scratch) {
    const int64_t T = j->T, nheads = j->nheads, headdim = j->headdim, d_state = j->d_state;
    const int64_t head_size = headdim * d_state, slot_size = nheads * head_size;
    const int64_t heads_per_group = nheads / j->ngroups;
    const int wide = d_state % 16 == 0 && headdim % 4 == 0 && hs_rows_isa(-1) == 1;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / nheads, h = u % nheads, g = h / heads_per_group;
        const float *prev = j->states + j->src[b] * slot_size + h * head_size;
        for (int64_t t = 0; t < T; ++t) {
            const int64_t slot = j->dst[b * T + t], parent = j->parents ? j->parents[b * T + t] : t - 1;
            if (parent != t - 1)  /* a tree's: the head's or an earlier input's snapshot */
                prev = j->states + (parent < 0 ? j->src[b] : j->dst[b * T + parent]) * slot_size + h * head_size;
            float *snap = slot >= 0 ? j->states + slot * slot_size + h * head_size : 0;
            /* streaming stores need their vector's alignment: 64 bytes for the AVX-512 loop */
            const int stream = snap && !j->parents && ((uintptr_t)snap & (wide ? 63 : 31)) == 0 && d_state % 8 == 0;
            const float dtv = j->dt[b * j->sdb + t * j->sdt + h];
            const float decay = expf(dtv * j->A[h]);
            const float *xv = j->x + b * j->sxb + t * j->sxt + h * j->sxh;
            const float *Bv = j->B + b * j->sBb + t * j->sBt + g * j->sBg;
            const float *Cv = j->C + b * j->sCb + t * j->sCt + g * j->sCg;
            float *yv = j->y + ((b * T + t) * nheads + h) * headdim;
            const head_input in = {prev, xv, Bv, Cv, scratch, snap, yv, dtv, decay, j->D[h], stream, headdim, d_state};
            if (wide) head_step512(&in, prev == scratch);
            else head_step(&in, 0, headdim);
            prev = scratch;
        }
    }
    stream_fence(); /* this thread's streamed snapshots are visible before its part counts as done */
}

/* With more than one thread the (row, head) units split into contiguous
 * ranges (`hs_parallel_units`, cpu/pool.c: one per thread, a few per thread
 * in a prefill): each unit is the same loop on any thread, so the bits do not
 * change. Parts past the first keep h_t in their thread's own head of scratch. */
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
                    int64_t ngroups, const int64_t *parents) {
    if (batch < 0 || T < 1 || nheads < 1 || headdim < 1 || d_state < 1 || ngroups < 1 || nheads % ngroups
        || !hs_parents_ok(parents, dst, batch, T))
        return -1;
    mamba2_job job = {states, scratch, y, src, dst, parents, x, dt, A, D, B, C, sxb, sxt, sxh, sdb, sdt, sBb, sBt, sBg,
                      sCb, sCt, sCg, batch, T, nheads, headdim, d_state, ngroups};
    const int64_t units = batch * nheads;
    if (hs_parallel_units(mamba2_part, &job, units, units * T * headdim * d_state, PARALLEL_MIN_FLOATS)) return 0;
    mamba2_units(&job, 0, units, scratch);
    return 0;
}
