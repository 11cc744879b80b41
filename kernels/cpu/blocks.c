/* Whole residual blocks of a decoder layer for few rows (decode, drafting, a
 * verify), on x86 CPUs: the other native kernels chained in one call, so
 * a block costs one call from Python instead of twenty-odd operations.
 *
 * hs_mlp_block:     out = h + m · down · (silu(gate · n) ⊙ (up · n)),   n = rmsnorm(h) ⊙ w
 * hs_mamba2_block:  out = h + m · out_proj · gated_rmsnorm(ssm(conv(x B C)), z),
 *                   [z | x B C | dt] = in_proj · n,   n = rmsnorm(h) ⊙ w
 * with the Mamba-2 mixer's conv window and recurrence written into the ring
 * slots of the plan exactly as `hs_conv_window_steps` and `hs_mamba2_steps`
 * write them (it calls them). h and out are [rows, hidden] contiguous;
 * weights are tagged addresses (cpu/kernels.h): panels, what `pack_for_cpu` stores, or input-major;
 * `work` is scratch memory of the size the Python side computes. Built by
 * `cpu/native.py`, used through `cpu/blocks.py`.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

/* out[i] = h[i] + out[i] · m over n values (the residual; out[i] · m rounded first, as torch's
 * h + update * m; no product where m is 1, as the module path skips it) */
static void add_into(float *out, const float *h, int64_t n, float m) {
    int64_t i = 0;
    if (m != 1.0f) {
        const v8 m8 = v8_set1(m);
        for (; i + 8 <= n; i += 8)
            v8_store(out + i, v8_add(v8_load(h + i), v8_mul(v8_load(out + i), m8)));
        for (; i < n; ++i) out[i] = h[i] + out[i] * m;
        return;
    }
    for (; i + 8 <= n; i += 8)
        v8_store(out + i, v8_add(v8_load(h + i), v8_load(out + i)));
    for (; i < n; ++i) out[i] = h[i] + out[i];
}

/* work: rows · (hidden + 2 · inter) floats */
int hs_mlp_block(const float *h, const float *norm_w, float eps, const float *gate_t, const float *up_t,
                 const float *down_t, float *work, float *out, int64_t rows, int64_t hidden, int64_t inter,
                 float residual) {
    if (rows < 1 || hidden < 1 || inter < 1) return -1;
    float *n = work, *g = n + rows * hidden, *u = g + rows * inter;
    if (hs_rms_norm(h, hidden, 0, 0, norm_w, n, rows, hidden, hidden, eps)) return -1;
    const float *gate_up[2] = {gate_t, up_t};
    const int64_t widths[2] = {inter, inter};
    float *const outs[2] = {g, u};
    if (hs_rows_matmul_many(n, hidden, rows, hidden, 2, gate_up, widths, outs)) return -1;  /* one job */
    const v8 one = v8_set1(1.0f);
    for (int64_t r = 0; r < rows; ++r) {  /* row by row: a value takes the same path in any batch */
        float *gr = g + r * inter, *ur = u + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {  /* silu(g) ⊙ u = g ⊙ u / (1 + e^-g) */
            v8 gi = v8_load(gr + i);
            v8 s = v8_div(gi, v8_add(one, exp8(v8_sub(v8_zero(), gi))));
            v8_store(gr + i, v8_mul(s, v8_load(ur + i)));
        }
        for (; i < inter; ++i) gr[i] = (gr[i] / (1.0f + expf(-gr[i]))) * ur[i];
    }
    if (hs_rows_matmul(g, inter, down_t, rows, inter, hidden, out)) return -1;
    add_into(out, h, rows * hidden, residual);
    return 0;
}

/* work: rows · (hidden + proj + conv_dim + nheads + 2 · d_inner) + headdim · d_state floats,
 * proj = 2 · d_inner + 2 · ngroups · d_state + nheads; rows = batch · T. `logged`, when not
 * NULL, is where the in_proj output [rows, proj], the conv output [rows, conv_dim] and Δ
 * [rows, nheads] go, one after the other, instead of `work` (the caller keeps them: the
 * input log of a verify forward). */
int hs_mamba2_block(const float *h, const float *norm_w, float eps, const float *in_t,
                    float *conv_states, float *ssm_states, const int64_t *src, const int64_t *dst,
                    const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D,
                    const float *gate_norm_w, int64_t group, const float *out_t, float *work, float *logged,
                    float *out, int64_t batch, int64_t T, int64_t hidden, int64_t d_inner, int64_t nheads,
                    int64_t headdim, int64_t ngroups, int64_t d_state, int64_t d_conv, float residual,
                    const hs_tree *tree) {
    const int64_t rows = batch * T, conv_dim = d_inner + 2 * ngroups * d_state, proj = d_inner + conv_dim + nheads;
    if (rows < 1 || hidden < 1 || nheads < 1 || headdim * nheads != d_inner || group < 1 || d_inner % group) return -1;
    float *n = work, *projected = logged ? logged : n + rows * hidden, *xbc = projected + rows * proj;
    float *dt = xbc + rows * conv_dim;
    float *y = n + rows * (hidden + proj + conv_dim + nheads), *g = y + rows * d_inner, *scratch = g + rows * d_inner;
    if (hs_rms_norm(h, hidden, 0, 0, norm_w, n, rows, hidden, hidden, eps)) return -1;
    if (hs_rows_matmul(n, hidden, in_t, rows, hidden, proj, projected)) return -1;  /* [rows, z | xBC | dt] */
    if (hs_conv_window_steps(conv_states, src, dst, projected + d_inner, T * proj, proj, conv_w, conv_b, 1, xbc,
                             batch, T, conv_dim, d_conv, tree ? tree->parents : 0)) return -1;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < nheads; ++k)
            dt[r * nheads + k] = hs_softplus(projected[r * proj + d_inner + conv_dim + k] + dt_bias[k]);
    const float *x = xbc, *B = xbc + d_inner, *C = B + ngroups * d_state;
    if (hs_mamba2_steps(ssm_states, src, dst, scratch, x, T * conv_dim, conv_dim, headdim, dt, T * nheads, nheads,
                        A, D, B, T * conv_dim, conv_dim, d_state, C, T * conv_dim, conv_dim, d_state, y,
                        batch, T, nheads, headdim, d_state, ngroups, tree ? tree->parents : 0)) return -1;
    if (hs_rms_norm(y, d_inner, projected, proj, gate_norm_w, g, rows, d_inner, group, eps)) return -1;
    if (hs_rows_matmul(g, d_inner, out_t, rows, d_inner, hidden, out)) return -1;
    add_into(out, h, rows * hidden, residual);
    return 0;
}

/* `count` (≤ 8) keys k_u = k + u · stride of head_dim floats, and the scores' scale */
typedef struct {
    const float *k;
    int64_t stride, count, head_dim;
    float scale;
} key_run;

/* s[u] = scale · q·k_u for the keys: eight independent sums reduced together by hsum8x8; a
 * key's score has the same bits however many keys come with it */
static inline void dot8(const float *q, const key_run *keys, float *s) {
    const float *k = keys->k;
    const int64_t stride = keys->stride, count = keys->count, head_dim = keys->head_dim;
    const float scale = keys->scale;
    const int64_t tail = head_dim / 8 * 8;
    v8 a[8];
    for (int u = 0; u < 8; ++u) a[u] = v8_zero();
    if (count == 8) {
        for (int64_t c = 0; c < tail; c += 8) {
            const v8 qv = v8_load(q + c);
            a[0] = v8_fmadd(qv, v8_load(k + c), a[0]);
            a[1] = v8_fmadd(qv, v8_load(k + stride + c), a[1]);
            a[2] = v8_fmadd(qv, v8_load(k + 2 * stride + c), a[2]);
            a[3] = v8_fmadd(qv, v8_load(k + 3 * stride + c), a[3]);
            a[4] = v8_fmadd(qv, v8_load(k + 4 * stride + c), a[4]);
            a[5] = v8_fmadd(qv, v8_load(k + 5 * stride + c), a[5]);
            a[6] = v8_fmadd(qv, v8_load(k + 6 * stride + c), a[6]);
            a[7] = v8_fmadd(qv, v8_load(k + 7 * stride + c), a[7]);
        }
    } else {
        for (int64_t c = 0; c < tail; c += 8) {
            const v8 qv = v8_load(q + c);
            for (int64_t u = 0; u < count; ++u) a[u] = v8_fmadd(qv, v8_load(k + u * stride + c), a[u]);
        }
    }
    float d[8];
    v8_store(d, hsum8x8(a));
    for (int64_t u = 0; u < count; ++u) {
        const float *ku = k + u * stride;
        for (int64_t c = tail; c < head_dim; ++c) d[u] += q[c] * ku[c];
        s[u] = d[u] * scale;
    }
}

/* s[0 … seen) ← softmax(s[0 … seen)) (the maximum is the same in any order:
 * eight lanes at a time) */
static void softmax_row(float *s, int64_t seen) {
    float top = s[0], total = 0.0f;
    int64_t p = 0;
    if (seen >= 8) {
        v8 top8 = v8_load(s);
        for (p = 8; p + 8 <= seen; p += 8) top8 = v8_max(top8, v8_load(s + p));
        float lanes[8];
        v8_store(lanes, top8);
        for (int u = 0; u < 8; ++u) top = lanes[u] > top ? lanes[u] : top;
    }
    for (; p < seen; ++p) top = s[p] > top ? s[p] : top;
    const v8 top8 = v8_set1(top);
    for (p = 0; p + 8 <= seen; p += 8) {
        v8 e = exp8(v8_sub(v8_load(s + p), top8));
        v8_store(s + p, e);
        total += hsum8(e);
    }
    for (; p < seen; ++p) total += (s[p] = expf(s[p] - top));
    const float inv = 1.0f / total;
    const v8 inv8 = v8_set1(inv);
    for (p = 0; p + 8 <= seen; p += 8) v8_store(s + p, v8_mul(v8_load(s + p), inv8));
    for (; p < seen; ++p) s[p] *= inv;
}

/* o[0 … head_dim) += Σ_{p < count} w[p] v_p, v_p = v + p · stride: 64 columns
 * at a time, their sums in 8 registers over the keys, so each column's sum is
 * one chain of fused multiply-adds in p order whatever the page boundaries */
static void weigh_values(float *o, const float *w, const float *v, int64_t stride, int64_t count, int64_t head_dim) {
    const int64_t tail = head_dim / 8 * 8;
    for (int64_t c0 = 0; c0 < tail; c0 += 64) {
        const int64_t width = tail - c0 < 64 ? (tail - c0) / 8 : 8;
        v8 acc[8];
        for (int64_t u = 0; u < width; ++u) acc[u] = v8_load(o + c0 + 8 * u);
        for (int64_t p = 0; p < count; ++p) {
            const float *vp = v + p * stride + c0;
            const v8 wp = v8_set1(w[p]);
            if (width == 8) {  /* the common case, unrolled */
                acc[0] = v8_fmadd(wp, v8_load(vp), acc[0]);
                acc[1] = v8_fmadd(wp, v8_load(vp + 8), acc[1]);
                acc[2] = v8_fmadd(wp, v8_load(vp + 16), acc[2]);
                acc[3] = v8_fmadd(wp, v8_load(vp + 24), acc[3]);
                acc[4] = v8_fmadd(wp, v8_load(vp + 32), acc[4]);
                acc[5] = v8_fmadd(wp, v8_load(vp + 40), acc[5]);
                acc[6] = v8_fmadd(wp, v8_load(vp + 48), acc[6]);
                acc[7] = v8_fmadd(wp, v8_load(vp + 56), acc[7]);
            } else {
                for (int64_t u = 0; u < width; ++u) acc[u] = v8_fmadd(wp, v8_load(vp + 8 * u), acc[u]);
            }
        }
        for (int64_t u = 0; u < width; ++u) v8_store(o + c0 + 8 * u, acc[u]);
    }
    for (int64_t p = 0; p < count && tail < head_dim; ++p)
        for (int64_t c = tail; c < head_dim; ++c) o[c] += w[p] * v[p * stride + c];
}

/* -- AVX-512, the same bits ---------------------------------------------------------------
 * Where the products run on AVX-512 (`hs_rows_isa`), the query heads that share a KV head
 * (grouped-query attention) share its key and value loads, and each instruction does two
 * heads' or sixteen columns' work. Every lane still runs the chain it runs above, so the
 * scores, the weighted values and the bits are the same on either path (tested):
 * - scores: a zmm holds two heads' eight-lane partial sums for one key, [head h | head h + 1],
 *   each lane the fused multiply-adds of dot8 over the key's 8-float chunks in order; the two
 *   halves then reduce by hsum8x8 as dot8's do.
 * - values: sixteen columns per vector, each column's sum one chain of fused multiply-adds in
 *   key order, as weigh_values' eight. */

/* dot8 for eight keys (count 8, head_dim a multiple of 8) and two query heads q0, q1 at once:
 * s0[u], s1[u] = scale · q·k_u, the bits of dot8's */
TARGET512 static void dot8_two_heads(const float *q0, const float *q1, const key_run *keys, float *s0, float *s1) {
    const float *k = keys->k;
    const int64_t stride = keys->stride, head_dim = keys->head_dim;
    const float scale = keys->scale;
    v16 a[8];
    _Pragma("GCC unroll 8") for (int u = 0; u < 8; ++u) a[u] = v16_zero();
    for (int64_t c = 0; c < head_dim; c += 8) {
        const v16 qv = v16_load_halves(q0 + c, q1 + c);
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; ++u)
            a[u] = v16_fmadd(qv, v16_load_twice(k + u * stride + c), a[u]);
    }
    v8 lo[8], hi[8];
    _Pragma("GCC unroll 8") for (int u = 0; u < 8; ++u) {
        lo[u] = v16_lo(a[u]);
        hi[u] = v16_hi(a[u]);
    }
    const v8 scale8 = v8_set1(scale);
    v8_store(s0, v8_mul(hsum8x8(lo), scale8));
    v8_store(s1, v8_mul(hsum8x8(hi), scale8));
}

/* weigh_values for `heads` (1 to 4) query heads sharing their values: o_j[0 … head_dim) +=
 * Σ_{p < count} w_j[p] v_p, o_j = o + j · o_step, w_j = w + j · w_step, v_p = v + p · stride */
typedef struct {
    float *o;
    const float *w, *v;
    int64_t o_step, w_step, stride, count, head_dim;
    int heads;
} shared_values;

/* shared_values' sums over the 64 columns from c0 for its HEADS heads */
#define DEFINE_WEIGH64(HEADS)                                                                           \
    TARGET512 static void weigh64_##HEADS(const shared_values *sv, int64_t c0) {                        \
        float *o = sv->o + c0;                                                                          \
        const float *w = sv->w, *v = sv->v + c0;                                                        \
        const int64_t o_step = sv->o_step, w_step = sv->w_step, stride = sv->stride, count = sv->count; \
        v16 acc[HEADS][4];                                                                              \
        _Pragma("GCC unroll 4") for (int j = 0; j < HEADS; ++j)                                         \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) acc[j][u] = v16_load(o + j * o_step + 16 * u); \
        for (int64_t p = 0; p < count; ++p) {                                                           \
            const float *vp = v + p * stride;                                                           \
            v16 vv[4];                                                                                  \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) vv[u] = v16_load(vp + 16 * u);          \
            _Pragma("GCC unroll 4") for (int j = 0; j < HEADS; ++j) {                                   \
                const v16 wp = v16_set1(w[j * w_step + p]);                                             \
                _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) acc[j][u] = v16_fmadd(wp, vv[u], acc[j][u]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 4") for (int j = 0; j < HEADS; ++j)                                         \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) v16_store(o + j * o_step + 16 * u, acc[j][u]); \
    }
DEFINE_WEIGH64(1) DEFINE_WEIGH64(2) DEFINE_WEIGH64(3) DEFINE_WEIGH64(4)
typedef void (*weigh64_fn)(const shared_values *, int64_t);
static const weigh64_fn WEIGH64[5] = {0, weigh64_1, weigh64_2, weigh64_3, weigh64_4};

/* shared_values' sums: 64 columns at a time on AVX-512, the columns past the last 64 by
 * weigh_values (the same chains) */
static void weigh_values_heads(const shared_values *sv) {
    const int64_t wide = sv->head_dim / 64 * 64;
    for (int64_t c0 = 0; c0 < wide; c0 += 64) WEIGH64[sv->heads](sv, c0);
    if (wide < sv->head_dim)
        for (int j = 0; j < sv->heads; ++j)
            weigh_values(sv->o + j * sv->o_step + wide, sv->w + j * sv->w_step, sv->v + wide, sv->stride, sv->count,
                         sv->head_dim - wide);
}

/* One row's attention (`attend`, `attend_row`): its queries q and outputs o (rows ld floats
 * apart), the caches, its page table, and the scores' scratch */
typedef struct {
    const float *q, *k_cache, *v_cache;
    float *o, *scores;
    const int64_t *table;
    int64_t ld, block_size, first, queries, nheads, kv_heads, head_dim;
    float scale;
    const uint64_t *seen;  /* a tree's: [queries] the inputs query i sees (hs_tree), or NULL: a chain */
} attend_job;

/* rows 0 … rows − 1 of a page at base (kv_dim floats apart), KV heads g0 … g1 − 1 of each, into L2:
 * a later page's keys or values while this page's are used (`attend`) */
static inline void prefetch_page_rows(const float *base, int64_t rows, int64_t kv_dim, int64_t g0, int64_t g1,
                                      int64_t head_dim) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t f = g0 * head_dim; f < g1 * head_dim; f += 16) prefetch_l2(base + r * kv_dim + f);
}

/* o[i, h] += Σ_{p < count} w_p v_p for query i's heads h0 … h1 - 1 (`attend`): the values of count keys
 * in a row from v (kv_dim floats apart), their weights from index w0 of each head's scores; as each
 * KV head's turn comes, that head's values of the page at `ahead` (NULL: none) into L2 */
static void weigh_keys(const attend_job *j, int64_t i, int64_t h0, int64_t h1, const float *v, int64_t w0,
                       int64_t count, int avx512, const float *ahead) {
    const int64_t queries = j->queries, n = j->first + queries, head_dim = j->head_dim, ld = j->ld;
    const int64_t group = j->nheads / j->kv_heads, kv_dim = j->kv_heads * head_dim;
    const int shared = avx512 && head_dim >= 64; /* each KV head's query heads, up to four at a time */
    float *o = j->o;
    const float *scores = j->scores;
    for (int64_t h = h0; h < h1;) {
        if (ahead && h % group == 0)
            prefetch_page_rows(ahead, j->block_size, kv_dim, h / group, h / group + 1, head_dim);
        if (shared) {
            const int64_t left = group - h % group, heads = left < 4 ? left : 4;
            const shared_values sv = {o + i * ld + h * head_dim, scores + (h * queries + i) * n + w0,
                                      v + (h / group) * head_dim, head_dim, queries * n, kv_dim, count, head_dim,
                                      (int)heads};
            weigh_values_heads(&sv);
            h += heads;
        } else {
            weigh_values(o + i * ld + h * head_dim, scores + (h * queries + i) * n + w0, v + (h / group) * head_dim,
                         kv_dim, count, head_dim);
            h += 1;
        }
    }
}

/* Causal attention of one row's queries over its pages: for query i (at
 * position first + i, i < queries) and query head h (KV head h / group),
 *     o[i, h] = Σ_{p <= first + i} softmax_p(scale · q[i, h]·k_p) v_p
 * q, o: [queries, nheads · head_dim] rows at stride ld; key p at
 * k_cache + (table[p / block_size] · block_size + p % block_size) · kv_dim
 * (all KV heads of a position in one row, as are the values). Page by page,
 * all heads and queries at once: each page of K and of V streams from memory
 * once per forward whatever the number of queries (a verify reads the
 * context once, not once per input), the scores eight keys of all heads at
 * a time (8 · kv_dim floats in a row). On AVX-512 the query heads of a KV
 * head share its key and value loads (above). While a page's keys (or
 * values) are read, the rows of the page PREFETCH_PAGES later go into L2
 * (`prefetch_page_rows`), each KV head's as that head's turn comes: pages
 * need not be neighbours, and each is too short for the hardware's prefetch
 * to get going (a decode step at 2,048 tokens, docs/results/llamacpp.md).
 * Two pages ahead, a KV head at a time, rather than the next page's whole rows
 * at once: a burst of a page's lines outruns the core's queue of misses, and
 * one page ahead is too close to hide a cold page's latency (docs/results/llamacpp.md).
 * scores: nheads · queries · (first + queries) floats. */
#define PREFETCH_PAGES 2
static void attend(const attend_job *j, int64_t g0, int64_t g1) {
    const float *q = j->q, *k_cache = j->k_cache, *v_cache = j->v_cache;
    float *o = j->o, *scores = j->scores;
    const int64_t *table = j->table;
    const int64_t ld = j->ld, block_size = j->block_size, first = j->first, queries = j->queries;
    const int64_t nheads = j->nheads, kv_heads = j->kv_heads, head_dim = j->head_dim;
    const float scale = j->scale;
    const int64_t n = first + queries, group = nheads / kv_heads, kv_dim = kv_heads * head_dim;
    const int64_t pages = (n + block_size - 1) / block_size, page_floats = block_size * kv_dim;
    const int64_t h0 = g0 * group, h1 = g1 * group;  /* the query heads of KV heads g0 … g1 - 1 */
    const int avx512 = head_dim % 8 == 0 && hs_rows_isa(-1) == 1;  /* the AVX-512 loops above */
    for (int64_t page = 0; page < pages; ++page) {  /* the scores */
        const int64_t p0 = page * block_size, p1 = p0 + block_size < n ? p0 + block_size : n;
        const float *kp = k_cache + table[page] * page_floats;
        const float *ahead = page + PREFETCH_PAGES < pages ? k_cache + table[page + PREFETCH_PAGES] * page_floats : NULL;
        for (int64_t i = 0; i < queries; ++i) {
            const int64_t end = first + i + 1 < p1 ? first + i + 1 : p1;  /* keys p0 … end - 1 */
            for (int64_t p = p0; p < end; p += 8) {  /* eight keys, all heads: 8 · kv_dim floats in a row */
                const int64_t count = end - p < 8 ? end - p : 8;
                for (int64_t h = h0; h < h1;) {
                    if (ahead && i == 0 && h % group == 0)
                        prefetch_page_rows(ahead + (p - p0) * kv_dim, count, kv_dim, h / group, h / group + 1, head_dim);
                    const key_run keys = {kp + (p - p0) * kv_dim + (h / group) * head_dim, kv_dim, count, head_dim,
                                          scale};
                    float *sh = scores + (h * queries + i) * n + p;
                    if (avx512 && count == 8 && h % group + 1 < group) {  /* h and h + 1 share the keys */
                        dot8_two_heads(q + i * ld + h * head_dim, q + i * ld + (h + 1) * head_dim, &keys, sh,
                                       sh + queries * n);
                        h += 2;
                    } else {
                        dot8(q + i * ld + h * head_dim, &keys, sh);
                        h += 1;
                    }
                }
            }
        }
    }
    for (int64_t i = 0; i < queries; ++i)
        for (int64_t h = h0; h < h1; ++h) {
            float *s = scores + (h * queries + i) * n;
            int64_t seen = first + i + 1;
            if (j->seen) {  /* a tree: the scores of the inputs query i sees, side by side after the context's */
                seen = first;
                for (int64_t u = 0; u <= i; ++u)
                    if (j->seen[i] >> u & 1) s[seen++] = s[first + u];
            }
            softmax_row(s, seen);
            for (int64_t d = 0; d < head_dim; ++d) o[i * ld + h * head_dim + d] = 0.0f;
        }
    for (int64_t page = 0; page < pages; ++page) {  /* o = Σ_p w_p v_p */
        const int64_t p0 = page * block_size, p1 = p0 + block_size < n ? p0 + block_size : n;
        const float *vp = v_cache + table[page] * page_floats;
        const float *ahead = page + PREFETCH_PAGES < pages ? v_cache + table[page + PREFETCH_PAGES] * page_floats : NULL;
        for (int64_t i = 0; i < queries; ++i) {
            const int64_t end = first + i + 1 < p1 ? first + i + 1 : p1;
            if (end <= p0) continue;
            if (!j->seen) {
                weigh_keys(j, i, h0, h1, vp, p0, end - p0, avx512, i == 0 ? ahead : NULL);
                continue;
            }
            /* a tree: the context's keys of the page, then each run of inputs query i sees, their
             * weights where the softmax packed them (one sum per column in key order, as a chain's) */
            const int64_t context_end = end < first ? end : first;
            if (context_end > p0) weigh_keys(j, i, h0, h1, vp, p0, context_end - p0, avx512, i == 0 ? ahead : NULL);
            int64_t packed = first;  /* the weight index of the next input query i sees */
            for (int64_t u = 0; first + u < end; ++u) {
                if (!(j->seen[i] >> u & 1)) continue;
                int64_t run = 1;
                while (first + u + run < end && (j->seen[i] >> (u + run) & 1)) ++run;
                if (first + u >= p0)
                    weigh_keys(j, i, h0, h1, vp + (first + u - p0) * kv_dim, packed, run, avx512, NULL);
                else if (first + u + run > p0)  /* a run from an earlier page: its part in this one */
                    weigh_keys(j, i, h0, h1, vp, packed + p0 - first - u, first + u + run - p0, avx512, NULL);
                packed += run;
                u += run - 1;
            }
        }
    }
}

/* One row's attention over its pages, its KV heads split over the threads
 * (cpu/pool.c) where the context is long enough: a head's scores, softmax
 * and weighted values are the same loops on any thread, so the bits do not
 * change, and each thread streams its heads' share of every K and V row. */
#define PARALLEL_MIN_KV_FLOATS (1 << 16) /* keys · kv_dim below which one thread attends */

static void attend_part(void *ctx, int part, int parts) {
    const attend_job *j = ctx;
    attend(j, j->kv_heads * part / parts, j->kv_heads * (part + 1) / parts);
}

static void attend_row(const attend_job *j) {
    const int threads = hs_threads(), parts = threads < j->kv_heads ? threads : (int)j->kv_heads;
    if (parts > 1 && (j->first + j->queries) * j->kv_heads * j->head_dim >= PARALLEL_MIN_KV_FLOATS
        && hs_parallel(attend_part, (void *)j, parts))
        return;
    attend_part((void *)j, 0, 1);
}

/* out = h + m · o_proj · attention(rope(q_proj · n), rope(k_proj · n), v_proj · n),  n = rmsnorm(h) ⊙ w,
 * with the new K/V written into this layer's pages first: input t of row b at
 * slot slot_mapping[b·T + t] (page · block_size + offset; -1: not written, a
 * padding input or K/V already cached). Query t of row b sits at position
 * context_lens[b] - query_lens[b] + t and sees the keys up to it; padding
 * inputs (t >= query_lens[b]) attend to nothing (zeros before o_proj).
 * k_cache, v_cache: [num_blocks · block_size, kv_heads, head_dim] of this
 * layer; block_tables [batch, max_blocks] (int64); inv_freq [half] the rotary
 * frequencies θ_i (NULL: no rotary embedding), the angles computed here in
 * float32 with the C library's cosf and sinf, so each position's angles are
 * the same in every forward. Over a tree (`hs_tree`) input t sits at
 * position context_lens[b] - query_lens[b] + its depth and sees the context
 * and the inputs its bits name, its ancestors' keys after the context's as
 * in the chain along its path (its K/V still go to slot_mapping[b·T + t]).
 * work: rows · (hidden + 2 · (nheads + kv_heads) · head_dim + 2 · half) +
 * T · nheads · max(context_lens) floats. */
int hs_attention_block(const float *h, const float *norm_w, float eps, const float *q_t, const float *k_t,
                       const float *v_t, const float *o_t, const float *inv_freq, int64_t half,
                       float *k_cache, float *v_cache, const int64_t *slot_mapping, const int64_t *block_tables,
                       int64_t max_blocks, int64_t block_size, const int64_t *context_lens,
                       const int64_t *query_lens, float scale, float *work, float *out, int64_t batch, int64_t T,
                       int64_t hidden, int64_t nheads, int64_t kv_heads, int64_t head_dim, float residual,
                       const hs_tree *tree) {
    const int64_t rows = batch * T, q_dim = nheads * head_dim, kv_dim = kv_heads * head_dim;
    if (rows < 1 || hidden < 1 || kv_heads < 1 || nheads % kv_heads || block_size < 1) return -1;
    float *n = work, *q = n + rows * hidden, *k = q + rows * q_dim, *v = k + rows * kv_dim;
    float *o = v + rows * kv_dim, *angles = o + rows * q_dim, *scores = angles + 2 * rows * half;
    if (hs_rms_norm(h, hidden, 0, 0, norm_w, n, rows, hidden, hidden, eps)) return -1;
    const float *qkv[3] = {q_t, k_t, v_t};
    const int64_t widths[3] = {q_dim, kv_dim, kv_dim};
    float *const outs[3] = {q, k, v};
    if (hs_rows_matmul_many(n, hidden, rows, hidden, 3, qkv, widths, outs)) return -1;  /* one job */
    if (inv_freq) {  /* the angles of each input's position, (float) p · θ_i as torch computes them */
        float *cos = angles, *sin = angles + rows * half;
        for (int64_t b = 0; b < batch; ++b)
            for (int64_t t = 0; t < T; ++t) {
                const float position = (float)(context_lens[b] - query_lens[b] + (tree ? tree->depths[b * T + t] : t));
                for (int64_t i = 0; i < half; ++i) {
                    const float angle = position * inv_freq[i];
                    cos[(b * T + t) * half + i] = cosf(angle);
                    sin[(b * T + t) * half + i] = sinf(angle);
                }
            }
        if (hs_rope(q, cos, sin, half, q, rows, nheads, head_dim, half)) return -1;
        if (hs_rope(k, cos, sin, half, k, rows, kv_heads, head_dim, half)) return -1;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        for (int64_t d = 0; d < kv_dim; ++d) {
            k_cache[slot * kv_dim + d] = k[r * kv_dim + d];
            v_cache[slot * kv_dim + d] = v[r * kv_dim + d];
        }
    }
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t queries = query_lens[b], first = context_lens[b] - queries;
        if (queries < 0 || queries > T || first < 0 || (first + queries + block_size - 1) / block_size > max_blocks)
            return -1;
        for (int64_t r = b * T + queries; r < (b + 1) * T; ++r)  /* padding inputs: zeros */
            for (int64_t d = 0; d < q_dim; ++d) o[r * q_dim + d] = 0.0f;
        if (queries == 0) continue;
        const attend_job job = {q + b * T * q_dim, k_cache, v_cache, o + b * T * q_dim, scores,
                                block_tables + b * max_blocks, q_dim, block_size, first, queries, nheads, kv_heads,
                                head_dim, scale, tree ? tree->seen + b * T : 0};
        attend_row(&job);
    }
    if (hs_rows_matmul(o, q_dim, o_t, rows, q_dim, hidden, out)) return -1;
    add_into(out, h, rows * hidden, residual);
    return 0;
}
