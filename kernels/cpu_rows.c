/* Few-row matrix products on x86 CPUs with AVX2 and FMA (AVX-512 where present): y = x @ w.
 *
 * x is [M, K] (rows `ldx` floats apart, unit column stride), w is [K, N]
 * contiguous (input-major: what `HybridModel.pack_for_cpu` stores), y is
 * [M, N] contiguous. Built by `cpu_native.py`, used through `cpu_rows.py` (see there for why).
 *
 * The weight is streamed in memory order, Q rows of w at a time, for groups
 * of up to GROUP_ROWS rows of x; the group's G·Q broadcasts of x and the Q
 * weight vectors stay in registers (no spills: G·Q + Q + 1 <= 16 ymm), and
 * each vector of y is loaded and stored once per Q weight rows. The groups
 * take k-blocks of KBLOCK weight rows in turn, so a second group reads the
 * block from cache. Software prefetch fetches the rows PREFETCH_ROWS ahead
 * (past the last row it names memory the kernel never reads; a prefetch
 * does not fault): with the weights out of cache, five rows (a verify of
 * γ + 1 = 5 inputs) then cost about 1.5× one row instead of 2.2×, the
 * arithmetic hiding behind the memory (the embedded target's products, one
 * interleaved run).
 *
 * Every output is the same chain of fused multiply-adds over k = 0, 1, …,
 * K - 1 starting from zero, whatever M, the row's group or position or the
 * column's position in a vector: a row's result does not depend on what else
 * is multiplied with it.
 *
 * On CPUs with AVX-512 the same steps run on 16 columns per vector (and more
 * weight rows per step: 32 registers), chosen once at run time. The chains
 * are the same, so the results are too, bit for bit: only the instruction
 * count changes (fewer loads, stores and multiply-adds per weight), which is
 * what a verify's rows are bound by once the weights are in cache.
 * `hs_rows_isa` reports and chooses the path (the tests compare them).
 *
 * From TILE_MIN_ROWS rows (a verify of γ + 1 = 5 inputs and up;
 * TILE_MIN_ROWS_CACHED for weights that fit in L2) register tiles take over,
 * with the same chains again (see `tiled_matmul`). With more than one thread, the
 * columns split over them (see "threads" below), each column still one
 * thread's chain.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"
#include <stdlib.h>
#include <string.h>

#define GROUP_ROWS 5     /* rows of x per register group */
#define KBLOCK 12        /* weight rows the groups take in turn (a multiple of every Q) */
#define PREFETCH_ROWS 8  /* how far ahead, in weight rows, the stream is prefetched */

/* y[0:G, 0:n1] += x[0:G, k:k+Q] @ w[k:k+Q, 0:n1], n1 a multiple of W (the columns per vector) */
#define DEFINE_STEP(NAME, TARGET, VEC, W, LOAD, STORE, FMA, SET1, G, Q)                                 \
    TARGET static void NAME##_##G##_##Q(const float *x, int64_t ldx, const float *w, int64_t N, int64_t k, \
                                        int64_t n1, float *y, int64_t ldy) {                            \
        VEC b[G][Q];                                                                                    \
        _Pragma("GCC unroll 12") for (int g = 0; g < G; ++g)                                            \
            _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q) b[g][q] = SET1(x[g * ldx + k + q]);    \
        const float *wk = w + k * N;                                                                    \
        for (int64_t n = 0; n < n1; n += W) {                                                           \
            if ((n & 15) == 0) /* one prefetch per cache line of each row */                            \
                _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q)                                    \
                    _mm_prefetch((const char *)(wk + (PREFETCH_ROWS + q) * N + n), _MM_HINT_T0);        \
            VEC a[Q];                                                                                   \
            _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q) a[q] = LOAD(wk + q * N + n);           \
            _Pragma("GCC unroll 12") for (int g = 0; g < G; ++g) {                                      \
                float *out = y + g * ldy + n;                                                           \
                VEC acc = LOAD(out);                                                                    \
                _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q) acc = FMA(b[g][q], a[q], acc);     \
                STORE(out, acc);                                                                        \
            }                                                                                           \
        }                                                                                               \
    }

#define AVX2_OPS __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps
#define AVX512_OPS __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps
#define EXPAND(MACRO, ...) MACRO(__VA_ARGS__)  /* the _OPS lists expanded into arguments first */
#define STEP8(G, Q) EXPAND(DEFINE_STEP, step, , AVX2_OPS, G, Q)
#define STEP16(G, Q) EXPAND(DEFINE_STEP, step16, TARGET512, AVX512_OPS, G, Q)
/* G·Q broadcasts, Q weight vectors and one sum in registers: 16 ymm, 32 zmm */
STEP8(1, 4) STEP8(1, 1) STEP8(2, 4) STEP8(2, 1) STEP8(3, 3) STEP8(3, 1) STEP8(4, 2) STEP8(4, 1) STEP8(5, 2) STEP8(5, 1)
STEP16(1, 12) STEP16(1, 1) STEP16(2, 6) STEP16(2, 1) STEP16(3, 6) STEP16(3, 1) STEP16(4, 6) STEP16(4, 1)
STEP16(5, 4) STEP16(5, 1)

typedef void (*step_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, float *, int64_t);
typedef struct {
    int width;                     /* columns per vector */
    step_fn q[GROUP_ROWS + 1];     /* Q weight rows per step, for G rows */
    step_fn one[GROUP_ROWS + 1];   /* one weight row per step */
    int q_of[GROUP_ROWS + 1];      /* that Q (each divides KBLOCK) */
} step_set;
static const step_set AVX2_STEPS = {8, {0, step_1_4, step_2_4, step_3_3, step_4_2, step_5_2},
                                    {0, step_1_1, step_2_1, step_3_1, step_4_1, step_5_1}, {0, 4, 4, 3, 2, 2}};
static const step_set AVX512_STEPS = {16, {0, step16_1_12, step16_2_6, step16_3_6, step16_4_6, step16_5_4},
                                      {0, step16_1_1, step16_2_1, step16_3_1, step16_4_1, step16_5_1},
                                      {0, 12, 6, 6, 6, 4}};
static const step_set *steps_in_use = 0; /* chosen on first use (hs_rows_isa) */

/* choice -1: report; 0: the AVX2 steps; 1: the AVX-512 steps (where the CPU has
 * AVX-512F). Returns the path in use after the call (0 or 1), or -1 for a
 * choice this CPU cannot take. The first use picks AVX-512 where there is one. */
int hs_rows_isa(int choice) {
    const int has512 = __builtin_cpu_supports("avx512f");
    if (choice == 0) steps_in_use = &AVX2_STEPS;
    else if (choice == 1 && has512) steps_in_use = &AVX512_STEPS;
    else if (choice == 1) return -1;
    else if (!steps_in_use) steps_in_use = has512 ? &AVX512_STEPS : &AVX2_STEPS;
    return steps_in_use == &AVX512_STEPS;
}

/* columns n0 <= n < n1 (those past the last multiple of 8), k0 <= k < k1: the same chain, one float at a time */
static void tail_columns(int G, const float *x, int64_t ldx, const float *w, int64_t N, int64_t k0, int64_t k1,
                         int64_t n0, int64_t n1, float *y, int64_t ldy) {
    for (int g = 0; g < G; ++g)
        for (int64_t n = n0; n < n1; ++n) {
            float s = y[g * ldy + n];
            for (int64_t k = k0; k < k1; ++k) s = fmaf(x[g * ldx + k], w[k * N + n], s);
            y[g * ldy + n] = s;
        }
}

/* Many rows (a batch's verify): register tiles. The weight streamed in memory
 * order re-reads every output vector once per few weight rows; past a few
 * rows that is what bounds the product. Here a tile of G rows × V vectors of
 * columns keeps its G·V sums in registers over a block of weight rows
 * (each weight vector loaded once per row group, each x value broadcast from
 * memory once per tile row), the tile's panel of the weight (the block's rows ×
 * V vectors) staying in cache for every row group. Each sum is loaded from y
 * and stored back once per block, so its chain of fused
 * multiply-adds still runs over k = 0, 1, …, K - 1 in order: the same bits as
 * the steps above. */
/* Weight rows per block, and how the weight is fetched ahead. By default blocks of TILE_K (a panel's
 * copy, 16 KiB, in L1), the tile calls prefetching the next block into L2, a share each. A weight
 * streamed from memory (past L2) multiplied by fewer than TILE_K_LONG_ROWS rows takes blocks of
 * TILE_K_STREAMED instead, and below AHEAD_MAX_ROWS rows each tile prefetches, weight row by weight
 * row, the next panel's part of the row into L1 instead of the next block: a block's rows are then
 * 16 (or 64) sequential streams, each fetched one panel ahead, which keeps the memory busy while
 * the tiles compute; with more rows the arithmetic bounds the product, and the longer blocks' fewer
 * loads and stores of the sums and the block prefetch win back. The 35.8M target's products (C
 * harness, weights out of cache, interleaved, median of 15, three runs), against blocks of 64 with
 * the next block prefetched and the steps below 16 rows: 6 / 8 / 10 / 15 rows 10.9–11.3 /
 * 11.5–12.4 / 12.8–13.5 / 16.1–16.5 → 9.3–9.7 / 10.0–10.2 / 10.4–10.6 / 12.0–12.3 ms; 20 / 24 / 30
 * rows 16.0–16.5 / 16.8–17.4 / 18.8–19.7 → 14.4–14.7 / 15.7–16.5 / 18.1–18.8 ms; 40 rows
 * 22.7–23.4 ms either way; at 60 and 80 rows the block prefetch ran 3–6% faster (31.0 / 39.7
 * against 31.9–32.5 / 42.0–42.2 ms), so they keep it. */
#define TILE_K 64
#define TILE_K_STREAMED 16
#define TILE_K_LONG_ROWS 24
#define AHEAD_MAX_ROWS 40
/* Rows from which the tiles run (fewer: the steps above, as fast or faster). Streamed from memory,
 * 5 rows and up (a verify of batch 1; C harness as above: 5 rows 9.7–10.1 ms in steps against
 * 9.4–9.5 in tiles, 4 rows the same either way). From cache the tiles win from 10 rows (the
 * embedded target's products at 10 rows: 0.89 against 1.00 ms in steps). */
#define TILE_MIN_ROWS 5
#define TILE_MIN_ROWS_CACHED 10
#define CACHED_WEIGHT_FLOATS (512 * 1024)

/* y[0:G, 0:V·W] += x[0:G, k0:k1] @ w[k0:k1, 0:V·W] (W columns per vector), prefetching the
 * `pf_lines` cache lines from `pf` on, a few per weight row, and with `ahead` each weight row's
 * next V·W columns (the next panel's part of the row) */
#define DEFINE_TILE(NAME, TARGET, VEC, W, LOAD, STORE, FMA, SET1, G, V)                                  \
    TARGET static void NAME##_##G##_##V(const float *x, int64_t ldx, const float *w, int64_t N, int64_t k0, \
                                        int64_t k1, float *y, int64_t ldy, const float *pf, int64_t pf_lines, \
                                        int ahead) {                                                    \
        VEC acc[G][V];                                                                                  \
        const int64_t pf_per_row = (pf_lines + (k1 - k0) - 1) / (k1 - k0);                             \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[g][v] = LOAD(y + g * ldy + W * v); \
        for (int64_t k = k0; k < k1; ++k) {                                                             \
            const float *wk = w + k * N;                                                                \
            for (int64_t l = (k - k0) * pf_per_row; l < (k - k0 + 1) * pf_per_row && l < pf_lines; ++l) \
                _mm_prefetch((const char *)(pf + 16 * l), _MM_HINT_T1);                                 \
            VEC b[V];                                                                                   \
            if (ahead)                                                                                  \
                _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) if (W * v % 16 == 0)                \
                    _mm_prefetch((const char *)(wk + W * V + W * v), _MM_HINT_T0);                      \
            _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) b[v] = LOAD(wk + W * v);               \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                       \
                const VEC a = SET1(x[g * ldx + k]);                                                     \
                _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[g][v] = FMA(a, b[v], acc[g][v]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) STORE(y + g * ldy + W * v, acc[g][v]);  \
    }

#define TILE16(G, V) EXPAND(DEFINE_TILE, tile16, TARGET512, AVX512_OPS, G, V)
#define TILE8(G, V) EXPAND(DEFINE_TILE, tile8, , AVX2_OPS, G, V)
/* AVX-512: 6 rows × 4 vectors (24 sums + 4 weight vectors in 32 registers), and
 * the narrower tiles for the last columns; AVX2: 4 rows × 3 vectors (12 + 3 of 16) */
TILE16(6, 4) TILE16(5, 4) TILE16(4, 4) TILE16(3, 4) TILE16(2, 4) TILE16(1, 4)
TILE16(6, 1) TILE16(5, 1) TILE16(4, 1) TILE16(3, 1) TILE16(2, 1) TILE16(1, 1)
TILE8(4, 3) TILE8(3, 3) TILE8(2, 3) TILE8(1, 3)
TILE8(4, 1) TILE8(3, 1) TILE8(2, 1) TILE8(1, 1)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, float *, int64_t,
                        const float *, int64_t, int);
typedef struct {
    int rows, width, vectors;            /* the widest tile: rows × vectors of `width` columns */
    tile_fn wide[7], one[7];             /* by rows: the wide tile and the one-vector tile */
} tile_set;
static const tile_set AVX512_TILES = {6, 16, 4, {0, tile16_1_4, tile16_2_4, tile16_3_4, tile16_4_4, tile16_5_4,
                                                 tile16_6_4},
                                      {0, tile16_1_1, tile16_2_1, tile16_3_1, tile16_4_1, tile16_5_1, tile16_6_1}};
static const tile_set AVX2_TILES = {4, 8, 3, {0, tile8_1_3, tile8_2_3, tile8_3_3, tile8_4_3},
                                    {0, tile8_1_1, tile8_2_1, tile8_3_1, tile8_4_1}};

/* y (zeroed) += x @ w with the tiles: blocks of `tile_k` weight rows, then
 * panels of columns, then row groups. A block's rows are contiguous in
 * memory; while one block is multiplied, the tile calls prefetch the next one
 * in memory order (each call a share, a line or two per weight row; with
 * `ahead`, each tile the next panel's part of its weight rows instead: see
 * TILE_K_STREAMED above), so the
 * weight streams from memory behind the arithmetic instead of stalling the
 * copy below (the 35.8M Bamba's products at 40 rows: 31 → 24 ms; a panel-major
 * order reads 256 bytes of each of 128 rows far apart, which no hardware
 * prefetcher follows). The tiles read the block where it lies, except where
 * its rows lie a multiple of 4 KiB apart (N a multiple of 1024): there they
 * would crowd into a few cache sets, so a wide panel's part of the block is
 * first copied into `packed` (`tile_k` rows of `panel` floats in a row). The
 * copy costs more than it saves elsewhere: reading in place is 5–25% faster
 * at 10–20 rows on the embedded and 35.8M targets' weights, even at 40 rows,
 * and 2–7% slower at 40 rows for N = 3072 or 4096 (C harness, weights in
 * cache). Every sum is loaded from y and stored back once per block, so its
 * chain stays k = 0, 1, …, K - 1. */
static void tiled_matmul(const tile_set *t, int64_t tile_k, int ahead, const float *x, int64_t ldx,
                         const float *w, int64_t M, int64_t K, int64_t N, float *y, int64_t ldy, int64_t c0,
                         int64_t c1, int part, int parts) {
    float packed[TILE_K * 64] __attribute__((aligned(64)));  /* 16 KiB of stack */
    const int64_t groups = (M + t->rows - 1) / t->rows, panel = (int64_t)t->width * t->vectors;
    const int64_t wide = c0 + (c1 - c0) / panel * panel, vec_end = c0 + (c1 - c0) / t->width * t->width;
    const int64_t vec8 = c0 + (c1 - c0) / 8 * 8;
    const int64_t calls = ((wide - c0) / panel + (vec_end - wide) / t->width) * groups;  /* tile calls per block */
    const int copy = N % 1024 == 0;  /* rows a multiple of 4 KiB apart */
    for (int64_t k0 = 0; k0 < K; k0 += tile_k) {
        const int64_t k1 = k0 + tile_k < K ? k0 + tile_k : K, k2 = k1 + tile_k < K ? k1 + tile_k : K;
        /* the next block, (k2 - k1) rows of N in memory order: this part's share of its lines */
        const int64_t block_lines = ahead ? 0 : (k2 - k1) * N / 16, first = block_lines * part / parts;
        const float *next = w + k1 * N + 16 * first;
        const int64_t lines = block_lines * (part + 1) / parts - first;
        int64_t call = 0;
        for (int64_t n0 = c0; n0 < vec8;) {
            /* this panel: `wide` columns in wide tiles, then single vectors, then one AVX2 vector */
            const int64_t step = n0 < wide ? panel : n0 < vec_end ? t->width : 8;
            if (step == panel && copy)
                for (int64_t k = k0; k < k1; ++k) {
                    if (ahead) /* the next panel's part of the row, as the tiles would */
                        for (int64_t l = 0; l < panel; l += 16)
                            _mm_prefetch((const char *)(w + k * N + n0 + panel + l), _MM_HINT_T0);
                    memcpy(packed + (k - k0) * panel, w + k * N + n0, sizeof(float) * panel);
                }
            for (int64_t group = 0; group < groups; ++group) {
                const int64_t m0 = M * group / groups, m1 = M * (group + 1) / groups;
                const int G = (int)(m1 - m0);
                const float *xg = x + m0 * ldx;
                float *yg = y + m0 * ldy + (n0 - c0);
                if (step == 8) {  /* one AVX2 vector left: AVX2 tiles of up to 4 rows, no prefetch */
                    for (int64_t g = 0; g < G; g += 4) {
                        const int rows = G - g < 4 ? (int)(G - g) : 4;
                        AVX2_TILES.one[rows](xg + g * ldx, ldx, w + n0, N, k0, k1, yg + g * ldy, ldy, 0, 0, 0);
                    }
                    continue;
                }
                const int64_t l0 = lines * call / calls, l1 = lines * (call + 1) / calls;
                ++call;
                if (step == panel && copy)
                    t->wide[G](xg + k0, ldx, packed, panel, 0, k1 - k0, yg, ldy, next + 16 * l0, l1 - l0, 0);
                else if (step == panel) t->wide[G](xg, ldx, w + n0, N, k0, k1, yg, ldy, next + 16 * l0, l1 - l0, ahead);
                else t->one[G](xg, ldx, w + n0, N, k0, k1, yg, ldy, next + 16 * l0, l1 - l0, ahead);
            }
            n0 += step;
        }
    }
    if (vec8 < c1) tail_columns((int)M, x, ldx, w + c0, N, 0, K, vec8 - c0, c1 - c0, y, ldy);
}

/* columns c0 <= n < c1 of x @ w into y (rows ldy floats apart, y[0] the row's
 * column c0): the tiles, or the row groups streaming the weight (part of
 * parts: this range's share of the tiles' prefetch) */
static void product_columns(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y,
                            int64_t ldy, int64_t c0, int64_t c1, int part, int parts) {
    for (int64_t m = 0; m < M; ++m) memset(y + m * ldy, 0, (size_t)(c1 - c0) * sizeof(float));
    const int cached = K * N <= CACHED_WEIGHT_FLOATS;
    if (M >= (cached ? TILE_MIN_ROWS_CACHED : TILE_MIN_ROWS)) {
        const int64_t tile_k = !cached && M < TILE_K_LONG_ROWS ? TILE_K_STREAMED : TILE_K;
        tiled_matmul(steps_in_use == &AVX512_STEPS ? &AVX512_TILES : &AVX2_TILES, tile_k,
                     !cached && M < AHEAD_MAX_ROWS, x, ldx, w, M, K, N, y, ldy, c0, c1, part, parts);
        return;
    }
    const step_set *set = steps_in_use;
    /* columns [c0, wide) in the chosen vectors, [wide, vec_end) in AVX2 ones, the rest one at a time */
    const int64_t groups = (M + GROUP_ROWS - 1) / GROUP_ROWS, wide = (c1 - c0) / set->width * set->width;
    const int64_t vec_end = (c1 - c0) / 8 * 8;
    const float *wc = w + c0;
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int64_t group = 0; group < groups; ++group) {
            int64_t m0 = M * group / groups, m1 = M * (group + 1) / groups;
            int G = (int)(m1 - m0), Q = set->q_of[G], Q8 = AVX2_STEPS.q_of[G];
            const float *xg = x + m0 * ldx;
            float *yg = y + m0 * ldy;
            int64_t k = k0;
            if (wide > 0) {
                for (; k + Q <= k1; k += Q) set->q[G](xg, ldx, wc, N, k, wide, yg, ldy);
                for (; k < k1; ++k) set->one[G](xg, ldx, wc, N, k, wide, yg, ldy);
            }
            if (wide < vec_end) {  /* 8 columns left over from 16-column vectors */
                for (k = k0; k + Q8 <= k1; k += Q8) AVX2_STEPS.q[G](xg, ldx, wc + wide, N, k, 8, yg + wide, ldy);
                for (; k < k1; ++k) AVX2_STEPS.one[G](xg, ldx, wc + wide, N, k, 8, yg + wide, ldy);
            }
            if (vec_end < c1 - c0) tail_columns(G, xg, ldx, wc, N, k0, k1, vec_end, c1 - c0, yg, ldy);
        }
    }
}

/* -- threads ------------------------------------------------------------------------------
 * With more than one thread (`hs_set_threads`), a product of at least
 * PARALLEL_MIN_MACS multiply-adds is split into column ranges of whole
 * 64-column panels, one per thread, run by `hs_parallel` (cpu_pool.c). A
 * column is computed by one thread with the same chain as ever, so the bits
 * do not depend on the thread count (tested). */
#define PARALLEL_MIN_MACS (1 << 16) /* below this the hand-off costs about what the split saves */

typedef struct {
    const float *x, *w;
    float *y;
    int64_t ldx, M, K, N;
} product_job;

/* Part `part` of the product. Its columns of y share cache lines (and the
 * pairs of lines the hardware prefetches together) with the next part's
 * wherever a row does not start on a 128-byte boundary, and the row groups
 * load and store y every few weight rows: written in place, two cores'
 * stores to those lines took each product back to one core's time (512 ×
 * 2320, 5 rows, C harness). So parts past the first are computed into the
 * thread's own memory, rows 128 bytes apart, and copied into y at the end. */
static _Thread_local float *own;
static _Thread_local size_t own_floats;

static void product_part(void *ctx, int part, int parts) {
    const product_job *j = ctx;
    const int64_t panels = j->N / 64;
    const int64_t c0 = panels * part / parts * 64, c1 = part + 1 == parts ? j->N : panels * (part + 1) / parts * 64;
    const int64_t ld = (c1 - c0 + 31) / 32 * 32;
    if (part > 0 && own_floats < (size_t)(j->M * ld)) {
        free(own);
        own_floats = 0;
        if (posix_memalign((void **)&own, 128, (size_t)(j->M * ld) * sizeof(float))) own = 0;
        else own_floats = (size_t)(j->M * ld);
    }
    if (part == 0 || !own) { /* the first part, or no memory: in place */
        product_columns(j->x, j->ldx, j->w, j->M, j->K, j->N, j->y + c0, j->N, c0, c1, part, parts);
        return;
    }
    product_columns(j->x, j->ldx, j->w, j->M, j->K, j->N, own, ld, c0, c1, part, parts);
    for (int64_t m = 0; m < j->M; ++m) memcpy(j->y + m * j->N + c0, own + m * ld, (size_t)(c1 - c0) * sizeof(float));
}

/* y[M, N] = x[M, K] @ w[K, N]; returns 0, or -1 for sizes it does not take.
 * Rows split into balanced groups of at most GROUP_ROWS (or tiles); columns
 * over the threads (see above). */
int hs_rows_matmul(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y) {
    if (M < 0 || K < 0 || N < 0 || (M > 1 && ldx < K)) return -1;
    if (M == 0 || N == 0) return 0;
    if (!steps_in_use) hs_rows_isa(-1);
    const int threads = hs_threads(), parts = threads < N / 64 ? threads : (int)(N / 64);
    if (parts > 1 && M * K * N >= PARALLEL_MIN_MACS) {
        product_job job = {x, w, y, ldx, M, K, N};
        if (hs_parallel(product_part, &job, parts)) return 0;
    }
    product_columns(x, ldx, w, M, K, N, y, N, 0, N, 0, 1);
    return 0;
}
