/* The gated delta rule over T inputs on x86 CPUs (AVX2 + FMA), straight into
 * the ring slots: the CPU counterpart of the Triton `gdn_verify`.
 *
 * For each row b and value head h (key head h / (heads / key_heads)), from
 * the state in slot src[b], for t = 0 … T - 1:
 *     r_t = S_{t-1}ᵀ k_t                                     [d_v]
 *     u_t = β_t (v_t − exp(g_t) r_t)                         (S'ᵀ k_t = exp(g_t) S_{t-1}ᵀ k_t)
 *     S_t = exp(g_t) S_{t-1} + k_t ⊗ u_t                     [d_k, d_v]
 *     o_t = S_tᵀ q_t                                         [d_v]
 * A head's state runs in blocks of 32 value columns (every column's update
 * reads only itself): a block of d_k × 32 floats (16 KiB for d_k = 128)
 * stays in L1 across the T inputs, in a scratch block, and is copied to
 * slot dst[b·T + t] (its snapshot) when that is ≥ 0, with streaming stores,
 * which skip reading the slot's lines first. Each step is two passes over
 * the block: r_t's sums, then the update with o_t's sums. Memory sees the
 * source state once and each snapshot once. Where q is NULL (a log replay)
 * no outputs are made. Built by `cpu/native.py`, used through `cpu/gdn.py`.
 *
 * states: [num_slots, heads, d_k, d_v] contiguous. q, k: [batch, T,
 * key_heads, d_k]; v: [batch, T, heads, d_v]; g, beta: [batch, T, heads];
 * each with unit innermost stride (the other strides passed). o: [batch, T,
 * heads, d_v] contiguous. d_v a multiple of 8, d_k at most GDN_MAX_DK.
 * Every row runs all T inputs.
 *
 * Over a tree (`parents`, cpu/kernels.h) input t starts from its parent's
 * state: the scratch block where the parent is t - 1, else the head slot or
 * the parent's snapshot slot (written earlier by the same loop, so no
 * streaming stores there); each step is the chain's, so an input gets the
 * bits it gets in the chain along its path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#include "simd.h"

#define BLOCK_VECS 4 /* value columns per block: 4 vectors of 8 */
#define BLOCK_COLS (8 * BLOCK_VECS)

typedef struct {
    float *states, *o;
    const int64_t *src, *dst, *parents;
    const float *q, *k, *v, *g, *beta;
    int64_t sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sbb, sbt;
    int64_t batch, T, heads, key_heads, d_k, d_v;
} gdn_job;

/* One input's step on a block of value columns: S_t from `prev` (row stride ldp) into `out` (row
 * stride BLOCK_COLS; NULL at the last input, which no step reads again) and `snap` (row stride
 * lds; streamed where `stream`), o_t into ov (NULL: no output); k_t, q_t (NULL: no output) and
 * the block's part of v_t at kv, qv, vv; exp(g_t) and β_t. */
typedef struct {
    const float *prev, *kv, *qv, *vv;
    float *out, *snap, *ov;
    int64_t ldp, lds, d_k;
    float decay, beta;
    int stream;
} block_input;

/* block_input's step on NV vectors of value columns */
static inline __attribute__((always_inline)) void block_step(const int NV, const block_input *in) {
    const float *prev = in->prev, *kv = in->kv, *qv = in->qv, *vv = in->vv;
    float *out = in->out, *snap = in->snap, *ov = in->ov;
    const int64_t ldp = in->ldp, lds = in->lds, d_k = in->d_k;
    const float decay = in->decay, beta = in->beta;
    const int stream = in->stream;
    v8 acc[BLOCK_VECS], u[BLOCK_VECS];
    for (int j = 0; j < NV; ++j) acc[j] = v8_zero();
    for (int64_t i = 0; i < d_k; ++i) { /* r = S_{t-1}ᵀ k */
        const v8 ki = v8_set1(kv[i]);
        for (int j = 0; j < NV; ++j) acc[j] = v8_fmadd(v8_load(prev + i * ldp + 8 * j), ki, acc[j]);
    }
    const v8 decay8 = v8_set1(decay), beta8 = v8_set1(beta);
    for (int j = 0; j < NV; ++j) { /* u = β (v − exp(g) r) */
        u[j] = v8_mul(beta8, v8_fnmadd(decay8, acc[j], v8_load(vv + 8 * j)));
        acc[j] = v8_zero();
    }
    for (int64_t i = 0; i < d_k; ++i) { /* S_t = exp(g) S_{t-1} + k ⊗ u;  o = S_tᵀ q */
        const v8 ki = v8_set1(kv[i]);
        const v8 qi = qv ? v8_set1(qv[i]) : v8_zero();
        for (int j = 0; j < NV; ++j) {
            const v8 next = v8_fmadd(v8_load(prev + i * ldp + 8 * j), decay8, v8_mul(ki, u[j]));
            if (out) v8_store(out + i * BLOCK_COLS + 8 * j, next);
            if (stream) v8_stream(snap + i * lds + 8 * j, next);
            else if (snap) v8_store(snap + i * lds + 8 * j, next);
            if (qv) acc[j] = v8_fmadd(next, qi, acc[j]);
        }
    }
    if (ov)
        for (int j = 0; j < NV; ++j) v8_store(ov + 8 * j, acc[j]);
}

/* The T inputs of one block of value columns c0 … c0 + 8·NV - 1 of row b, head h. */
static inline __attribute__((always_inline)) void block_steps(const int NV, const gdn_job *j, int64_t b, int64_t h,
                                                              int64_t c0, float *scratch) {
    const int64_t T = j->T, d_k = j->d_k, d_v = j->d_v, head_size = d_k * d_v;
    const int64_t slot_size = j->heads * head_size, hk = h / (j->heads / j->key_heads);
    const float *prev = j->states + j->src[b] * slot_size + h * head_size + c0;
    int64_t ldp = d_v;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = j->dst[b * T + t], parent = j->parents ? j->parents[b * T + t] : t - 1;
        if (parent != t - 1) {  /* a tree's: the head's or an earlier input's snapshot */
            prev = j->states + (parent < 0 ? j->src[b] : j->dst[b * T + parent]) * slot_size + h * head_size + c0;
            ldp = d_v;
        }
        float *snap = slot >= 0 ? j->states + slot * slot_size + h * head_size + c0 : 0;
        /* d_v % 8 == 0: every row aligned alike */
        const int stream = snap && !j->parents && ((uintptr_t)snap & 31) == 0;
        const float *kv = j->k + b * j->skb + t * j->skt + hk * j->skh;
        const float *qv = j->q ? j->q + b * j->sqb + t * j->sqt + hk * j->sqh : 0;
        const float *vv = j->v + b * j->svb + t * j->svt + h * j->svh + c0;
        const float decay = expf(j->g[b * j->sgb + t * j->sgt + h]), beta = j->beta[b * j->sbb + t * j->sbt + h];
        float *ov = j->o && j->q ? j->o + ((b * T + t) * j->heads + h) * d_v + c0 : 0;
        const block_input in = {prev, kv, qv, vv, t + 1 < T ? scratch : 0, snap, ov, ldp, d_v, d_k, decay, beta,
                                stream};
        block_step(NV, &in);
        prev = scratch;
        ldp = BLOCK_COLS;
    }
}

/* the recurrence of (row, value head) units u0 <= u < u1 (u = b · heads + h) */
static void gdn_units(const gdn_job *j, int64_t u0, int64_t u1) {
    float scratch[GDN_MAX_DK * BLOCK_COLS] __attribute__((aligned(64)));
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / j->heads, h = u % j->heads;
        int64_t c0 = 0;
        for (; c0 + BLOCK_COLS <= j->d_v; c0 += BLOCK_COLS) block_steps(BLOCK_VECS, j, b, h, c0, scratch);
        switch ((j->d_v - c0) / 8) { /* the last columns: 1 to 3 vectors */
        case 3: block_steps(3, j, b, h, c0, scratch); break;
        case 2: block_steps(2, j, b, h, c0, scratch); break;
        case 1: block_steps(1, j, b, h, c0, scratch); break;
        default: break;
        }
    }
    stream_fence(); /* this thread's streamed snapshots are visible before its part counts as done */
}

/* With more than one thread the (row, value head) units split into
 * contiguous ranges (`hs_parallel_units`, cpu/pool.c: one per thread, a few
 * per thread in a prefill): each unit is the same loop on any thread, so the
 * bits do not change. */
#define PARALLEL_MIN_FLOATS (1 << 16) /* state floats updated (units · T · head) below which one thread runs */

static void gdn_part(void *ctx, int part, int parts) {
    const gdn_job *j = ctx;
    const int64_t units = j->batch * j->heads;
    gdn_units(j, units * part / parts, units * (part + 1) / parts);
}

int hs_gdn_steps(float *states, const int64_t *src, const int64_t *dst,
                 const float *q, int64_t sqb, int64_t sqt, int64_t sqh,
                 const float *k, int64_t skb, int64_t skt, int64_t skh,
                 const float *v, int64_t svb, int64_t svt, int64_t svh,
                 const float *g, int64_t sgb, int64_t sgt, const float *beta, int64_t sbb, int64_t sbt,
                 float *o, int64_t batch, int64_t T, int64_t heads, int64_t key_heads, int64_t d_k, int64_t d_v,
                 const int64_t *parents) {
    if (batch < 0 || T < 1 || heads < 1 || key_heads < 1 || heads % key_heads || d_k < 1 || d_k > GDN_MAX_DK
        || d_v < 8 || d_v % 8 || !hs_parents_ok(parents, dst, batch, T))
        return -1;
    gdn_job job = {states, o, src, dst, parents, q, k, v, g, beta, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                   sgb, sgt, sbb, sbt, batch, T, heads, key_heads, d_k, d_v};
    const int64_t units = batch * heads;
    if (hs_parallel_units(gdn_part, &job, units, units * T * d_k * d_v, PARALLEL_MIN_FLOATS)) return 0;
    gdn_units(&job, 0, units);
    return 0;
}
