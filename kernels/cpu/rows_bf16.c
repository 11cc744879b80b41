/* Products in bfloat16 compute on x86 CPUs with AVX512-BF16: y = bf16(x) @ w, float32 sums.
 *
 * The opt-in fast 16-bit path (`compute="bfloat16"`, `kernels/backend.py`): not bit-equal to
 * float32. x is [M, K] float32 (rows `ldx` floats apart), w is [K, N] bfloat16, contiguous
 * (input-major: a MoE's experts; `cpu/panels.c` takes `pack_for_cpu`'s panels with the same
 * bits), y is [M, N] float32. Each activation is
 * rounded to bfloat16 (to nearest, ties to even: torch's `x.bfloat16()`, llama.cpp's
 * GGML_FP32_TO_BF16), then dpbf16 (`v16_dot_bf16`, cpu/simd.h) multiplies pairs of them by pairs of weights
 * (k = 2j, 2j + 1) and adds both products to a float32 sum: half the instructions of the exact
 * path's widened multiply-adds and no widening, which is what bounds a verify's or a batch's rows
 * once the weights are in cache (a decode step streams the same bytes as the exact path's
 * bfloat16 weights).
 *
 * Every output is the same chain of dpbf16 steps over the pairs j = 0, 1, …, ceil(K/2) - 1 in
 * order, starting from zero (an odd K's last pair padded with zeros), whatever M, the row's group,
 * the column's place in a vector or the thread that computes it: a row's result does not depend on
 * what else is multiplied with it, nor on the thread count (the columns split over threads by
 * `cpu/rows.c`, which calls `hs_bf16_columns` for weights tagged HS_BF16_COMPUTE).
 *
 * The loop: chunks of CHUNK_ROWS rows; in each, blocks of BLOCK_PAIRS pairs of weight rows, whose
 * activations are rounded once. Up to STREAM_MAX_ROWS rows (a decode step, a verify, a small
 * batch), `step_G` streams the weight in memory order, STEP_PAIRS pairs of rows at a time across
 * the columns (GROUPS_STEP_PAIRS with several groups), the next pass prefetched into L2,
 * interleaving each 64 columns of a pair (w[2j][n] and w[2j+1][n] side by side: what
 * dpbf16 takes) in registers, for groups of up to STEP_MAX_ROWS rows in turn. More rows: each 64
 * column panel's block is interleaved once into `packed` (the next panel's rows prefetched
 * meanwhile), and `tile_G` keeps the sums of up to TILE_ROWS rows × 64 columns in registers over
 * the block. Either loads each sum from y and stores it back between passes, so each chain still
 * runs over j in order.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define BLOCK_PAIRS 32  /* pairs of weight rows per block: a panel's interleaved block is 8 KiB (L1) */
#define PANEL 64        /* columns per panel: 4 vectors of 16 sums; the threads split at multiples of 64 */
#define TILE_ROWS 6     /* 6 rows × 4 vectors of sums + 4 weight vectors + a broadcast: 29 of 32 zmm */
#define STEP_PAIRS 4    /* pairs of weight rows a streaming step takes across the columns, */
#define GROUPS_STEP_PAIRS 8 /* and with several groups (the later ones reading the pass from cache: longer
                             * passes load and store the sums less often) */
#define STEP_MAX_ROWS 4 /* rows per streaming step: 4 × 4 sums, 4 + 4 weight vectors, 2 indices */
/* rows up to which the weight streams through the steps, groups of up to STEP_MAX_ROWS in turn (the
 * later groups reading the pass from cache): faster than the tiles from 5 to 12 rows when the weight
 * comes from memory, and even up to 20 (docs/results/llamacpp.md, "bfloat16 compute") */
#define STREAM_MAX_ROWS 24
#define CHUNK_ROWS 96   /* rows whose rounded block of activations is kept (12 KiB of stack) */

int hs_bf16_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}

/* rows m0 <= m < m1 of x, pairs j0 <= j < j1, as dpbf16 takes them:
 * xp[(m - m0)·BLOCK_PAIRS + j - j0] = bf16(x[m][2j]) | bf16(x[m][2j + 1]) << 16 (0 past K) */
static void round_pairs(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t j0, int64_t j1,
                        uint32_t *xp) {
    for (int64_t m = m0; m < m1; ++m) {
        const float *xm = x + m * ldx;
        uint32_t *pm = xp + (m - m0) * BLOCK_PAIRS - j0;
        for (int64_t j = j0; j < j1; ++j)
            pm[j] = bf16_pair(xm, j, K);
    }
}

/* the lanes of a panel's 4 vectors that hold its first `cols` columns */
static inline void panel_masks(int64_t cols, mask16 mask[4]) {
    for (int v = 0; v < 4; ++v) {
        const int64_t left = cols - 16 * v;
        mask[v] = left >= 16 ? (mask16)0xffff : left <= 0 ? 0 : (mask16)((1u << left) - 1);
    }
}

/* y[0:G, 0:64 (masked)] += xp's G rows (BLOCK_PAIRS apart) by the interleaved block, `pairs` pairs */
#define DEFINE_TILE(G)                                                                                       \
    TARGET_BF16 static void tile_##G(const uint32_t *xp, int64_t pairs,                                     \
                                     const v16i *packed, float *y, int64_t ldy, const mask16 mask[4]) {     \
        v16 acc[G][4];                                                                                       \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                              \
                acc[g][v] = v16_load_masked(mask[v], y + g * ldy + 16 * v);                                  \
        for (int64_t j = 0; j < pairs; ++j) {                                                                \
            const v16i *p = packed + 4 * j;                                                                  \
            const v16i w0 = v16i_load_aligned(p), w1 = v16i_load_aligned(p + 1);                             \
            const v16i w2 = v16i_load_aligned(p + 2), w3 = v16i_load_aligned(p + 3);                         \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                            \
                const v16bh a = v16bh_set1((int)xp[g * BLOCK_PAIRS + j]);                                    \
                acc[g][0] = v16_dot_bf16(acc[g][0], a, w0);                                                  \
                acc[g][1] = v16_dot_bf16(acc[g][1], a, w1);                                                  \
                acc[g][2] = v16_dot_bf16(acc[g][2], a, w2);                                                  \
                acc[g][3] = v16_dot_bf16(acc[g][3], a, w3);                                                  \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                              \
                v16_store_masked(y + g * ldy + 16 * v, mask[v], acc[g][v]);                                  \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

/* Few rows (a decode step, a verify, a small batch): the weight streamed in memory order, a pass of
 * pairs j0 <= j < j1 of weight rows across all the columns (2·(j1 - j0) sequential streams),
 * y[0:G, c0:c1] += xp's G rows (BLOCK_PAIRS apart) by that pass */
typedef struct {
    const uint32_t *xp;  /* the G rows' rounded pairs, BLOCK_PAIRS apart, xp[0] pair j0 */
    const uint16_t *w;   /* the weight [K, N] */
    int64_t K, N, j0, j1, c0, c1;
    float *y;            /* the G rows' columns c0 … c1 - 1, ldy floats apart */
    int64_t ldy;
} stream_pass;
#define DEFINE_STEP(G)                                                                                       \
    TARGET_BF16 static void step_##G(const stream_pass *s) {                                                 \
        const uint32_t *xp = s->xp;                                                                          \
        const uint16_t *w = s->w;                                                                            \
        const int64_t K = s->K, N = s->N, j0 = s->j0, j1 = s->j1, c0 = s->c0, c1 = s->c1, ldy = s->ldy;      \
        float *y = s->y;                                                                                     \
        for (int64_t n0 = c0; n0 < c1; n0 += PANEL) {                                                        \
            const int64_t cols = c1 - n0 < PANEL ? c1 - n0 : PANEL;                                          \
            mask16 mask[4];                                                                                  \
            panel_masks(cols, mask);                                                                         \
            v16 acc[G][4];                                                                                   \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                              \
                _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                          \
                    acc[g][v] = v16_load_masked(mask[v], y + g * ldy + (n0 - c0) + 16 * v);                  \
            for (int64_t j = j0; j < j1; ++j) {                                                              \
                const uint16_t *r0 = w + 2 * j * N + n0, *r1 = 2 * j + 1 < K ? r0 + N : 0;                   \
                /* the next pass's rows, into L2 (a pass of a wide weight outgrows L1) */                  \
                const uint16_t *ahead = r0 + 2 * (j1 - j0) * N;                                              \
                if (2 * (j + j1 - j0) < K) {                                                                 \
                    prefetch_l2(ahead);                                                                      \
                    prefetch_l2(ahead + 32);                                                                 \
                }                                                                                            \
                if (2 * (j + j1 - j0) + 1 < K) {                                                             \
                    prefetch_l2(ahead + N);                                                                  \
                    prefetch_l2(ahead + N + 32);                                                             \
                }                                                                                            \
                v16i p[4];                                                                                   \
                bf16_interleave64(r0, r1, cols, p);                                                          \
                _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                        \
                    const v16bh a = v16bh_set1((int)xp[g * BLOCK_PAIRS + j - j0]);                           \
                    _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                      \
                        acc[g][v] = v16_dot_bf16(acc[g][v], a, p[v]);                                        \
                }                                                                                            \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                              \
                _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                          \
                    v16_store_masked(y + g * ldy + (n0 - c0) + 16 * v, mask[v], acc[g][v]);                  \
        }                                                                                                    \
    }
DEFINE_STEP(1)
DEFINE_STEP(2)
DEFINE_STEP(3)
DEFINE_STEP(4)

typedef void (*step_fn)(const stream_pass *);
static const step_fn STEPS[STEP_MAX_ROWS + 1] = {0, step_1, step_2, step_3, step_4};

typedef void (*tile_fn)(const uint32_t *, int64_t, const v16i *, float *, int64_t, const mask16 *);
static const tile_fn TILES[TILE_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* columns c0 <= n < c1 of bf16(x) @ w into y (rows ldy floats apart, y[0] the row's column c0), in
 * chunks of CHUNK_ROWS rows, each rounding its block of activations once */
TARGET_BF16 void hs_bf16_columns(const float *x, int64_t ldx, const uint16_t *w, int64_t M, int64_t K, int64_t N,
                                 float *y, int64_t ldy, int64_t c0, int64_t c1) {
    const int64_t K2 = (K + 1) / 2;
    uint32_t xp[CHUNK_ROWS * BLOCK_PAIRS] __attribute__((aligned(64)));
    v16i packed[BLOCK_PAIRS * 4];
    for (int64_t m = 0; m < M; ++m) memset(y + m * ldy, 0, (size_t)(c1 - c0) * sizeof(float));
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = m0 + CHUNK_ROWS < M ? m0 + CHUNK_ROWS : M;
        for (int64_t j0 = 0; j0 < K2; j0 += BLOCK_PAIRS) {
            const int64_t j1 = j0 + BLOCK_PAIRS < K2 ? j0 + BLOCK_PAIRS : K2;
            round_pairs(x, ldx, m0, m1, K, j0, j1, xp);
            if (m1 - m0 <= STREAM_MAX_ROWS) {
                const int64_t groups = (m1 - m0 + STEP_MAX_ROWS - 1) / STEP_MAX_ROWS;
                const int64_t pass = groups > 1 ? GROUPS_STEP_PAIRS : STEP_PAIRS;
                for (int64_t j = j0; j < j1; j += pass)
                    for (int64_t group = 0; group < groups; ++group) {
                        const int64_t g0 = m0 + (m1 - m0) * group / groups, g1 = m0 + (m1 - m0) * (group + 1) / groups;
                        const stream_pass s = {xp + (g0 - m0) * BLOCK_PAIRS + j - j0, w, K, N, j,
                                               j + pass < j1 ? j + pass : j1, c0, c1, y + g0 * ldy, ldy};
                        STEPS[g1 - g0](&s);
                    }
                continue;
            }
            for (int64_t n0 = c0; n0 < c1; n0 += PANEL) {
                const int64_t cols = c1 - n0 < PANEL ? c1 - n0 : PANEL;
                for (int64_t j = j0; j < j1; ++j) {
                    const uint16_t *r0 = w + 2 * j * N + n0, *r1 = 2 * j + 1 < K ? r0 + N : 0;
                    if (n0 + PANEL < c1) { /* the next panel's part of these rows, while this one computes */
                        prefetch_l1(r0 + PANEL);
                        prefetch_l1(r0 + PANEL + 32);
                        if (r1) prefetch_l1(r1 + PANEL);
                        if (r1) prefetch_l1(r1 + PANEL + 32);
                    }
                    bf16_interleave64(r0, r1, cols, packed + 4 * (j - j0));
                }
                mask16 mask[4];
                panel_masks(cols, mask);
                for (int64_t m = m0; m < m1; m += TILE_ROWS) {
                    const int G = m1 - m < TILE_ROWS ? (int)(m1 - m) : TILE_ROWS;
                    TILES[G](xp + (m - m0) * BLOCK_PAIRS, j1 - j0, packed, y + m * ldy + (n0 - c0), ldy, mask);
                }
            }
        }
    }
}
