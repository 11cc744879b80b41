/* Products whose weight lies in panels (`kernels/cpu/panels.py`, what `HybridModel.pack_for_cpu` stores):
 * y = x @ w, the bits of `cpu/rows.c`'s products on the same values.
 *
 * A weight w [K, N] (the input-major view of [out, in]) in panels: PANEL columns each, all K rows of
 * a panel contiguous, the panels one after another. With R rows side by side (R = 2 for bfloat16, 1
 * for float32 and float16), w[k][n] lies at
 *     ((n / PANEL) · Kr + k / R) · PANEL · R + (n % PANEL) · R + k % R,    Kr = ceil(K / R),
 * zero past K and N. A panel row (R weight rows of its PANEL columns) is 256 bytes (128 for
 * float16). Bfloat16 pairs rows 2j and 2j + 1: a 32-bit lane holds w[2j][n] in its low half and
 * w[2j + 1][n] in its high half, which a shift and a mask widen into two float32 vectors and which
 * AVX512-BF16's dot product takes as they are.
 *
 * Why: a few rows' product (a decode step, a verify, a small batch) is bound by streaming its weight
 * from memory. Here each panel is one sequential stream and a tile keeps its rows' sums in registers
 * over all of K; the input-major layout reads a dozen rows far apart at once and loads and stores
 * the sums every few of them, which streamed the same bytes slower, most of all for bfloat16 and
 * a verify's few rows (docs/results/llamacpp.md, "Panels").
 *
 * Every output is the chain of fused multiply-adds over k = 0, 1, …, K - 1 from zero (bfloat16
 * compute: of dpbf16 steps over the pairs), as in `cpu/rows.c` and `cpu/rows_bf16.c`: the same
 * bits whatever M, the row's group, the column's place, the thread or the vector path.
 *
 * Rows in groups of up to a tile's rows (6 on AVX-512, 2 on AVX2), chunks of up to CHUNK_ROWS. A
 * panel of up to STREAM_PANEL_BYTES is streamed whole: the first group's tile runs over all of K,
 * fetching the stream PREFETCH_ROWS panel rows ahead, and the other groups' tiles read the panel
 * from L2, each tile's sums in registers throughout: faster from 8 to 96 rows than blocks of
 * BLOCK_K rows kept in L1 (docs/results/llamacpp.md, "Panels"). A larger panel
 * (K past 2,048 float32 or 4,096 bfloat16 values) takes those blocks, the first group fetching the
 * next; the sums are then loaded from y and stored back once per block, so each chain still runs
 * over k in order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define BLOCK_K 64       /* weight rows per block of a panel too large to stream whole */
#define CHUNK_ROWS 96    /* rows per chunk: a last, narrower panel is computed into 24 KiB of stack */
#define PREFETCH_ROWS 16 /* how far ahead a single group fetches its stream: 4 KiB */
#define STREAM_PANEL_BYTES (512 << 10) /* panels up to this size are streamed whole (they stay in L2) */

/* prefetch the `bytes` (a panel row) at `p` */
#define PREFETCH_ROW(p, bytes)                                                                          \
    _Pragma("GCC unroll 4") for (int line = 0; line < (bytes); line += 64)                              \
        prefetch_l1((const char *)(p) + line)

#define AVX2_VEC v8, 8, v8_load, v8_store, v8_fmadd, v8_set1, v8_zero
#define AVX512_VEC v16, 16, v16_load, v16_store, v16_fmadd, v16_set1, v16_zero
#define EXPAND(MACRO, ...) MACRO(__VA_ARGS__)

/* The tiles: y[0:G, 0:4·W] (first: =, else +=) x[0:G, k0:k1] @ the panel's rows k0 … k1 - 1, for
 * the 4·W columns at `wp` (a panel, or its second half on AVX2); with `ahead`, each panel row
 * fetched that many rows ahead first. One weight row at a time (R = 1): */
#define DEFINE_TILE1(NAME, WT, WLOAD, TARGET, VEC, W, LOAD, STORE, FMA, SET1, ZERO, G)                      \
    TARGET static void NAME##_##G(const float *x, int64_t ldx, const WT *wp, int64_t k0, int64_t k1,      \
                                  float *y, int64_t ldy, int first, int64_t ahead) {                      \
        VEC acc[G][4];                                                                                    \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                           \
                acc[g][v] = first ? ZERO() : LOAD(y + g * ldy + W * v);                                   \
        for (int64_t k = k0; k < k1; ++k) {                                                               \
            const WT *row = wp + k * PANEL;                                                               \
            if (ahead) PREFETCH_ROW(row + ahead * PANEL, PANEL * (int)sizeof(WT));                        \
            VEC b[4];                                                                                     \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) b[v] = WLOAD(row + W * v);                \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                         \
                const VEC a = SET1(x[g * ldx + k]);                                                       \
                _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) acc[g][v] = FMA(a, b[v], acc[g][v]);  \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) STORE(y + g * ldy + W * v, acc[g][v]);   \
    }

/* Bfloat16 pairs (R = 2): each vector of W pairs widened into its even row (a shift) and its odd row
 * (a mask), multiplied in that order; an odd K's last pair has its even row only */
#define DEFINE_TILE2(NAME, IVEC, ILOAD, SLLI, AND, SET1I, CAST, TARGET, VEC, W, LOAD, STORE, FMA, SET1, ZERO, G) \
    TARGET static void NAME##_##G(const float *x, int64_t ldx, const uint16_t *wp, int64_t k0, int64_t k1,     \
                                  float *y, int64_t ldy, int first, int64_t ahead) {                         \
        VEC acc[G][4];                                                                                       \
        const IVEC high = SET1I((int)0xffff0000u);                                                           \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                              \
                acc[g][v] = first ? ZERO() : LOAD(y + g * ldy + W * v);                                      \
        int64_t k = k0;                                                                                      \
        for (; k + 1 < k1; k += 2) {                                                                         \
            const uint16_t *row = wp + k * PANEL;                                                            \
            if (ahead) PREFETCH_ROW(row + 2 * ahead * PANEL, 2 * PANEL * (int)sizeof(uint16_t));             \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) {                                            \
                const IVEC pair = ILOAD((const void *)(row + 2 * W * v));                                    \
                const VEC even = CAST(SLLI(pair, 16)), odd = CAST(AND(pair, high));                          \
                _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                        \
                    acc[g][v] = FMA(SET1(x[g * ldx + k]), even, acc[g][v]);                                  \
                    acc[g][v] = FMA(SET1(x[g * ldx + k + 1]), odd, acc[g][v]);                               \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        if (k < k1) {                                                                                        \
            const uint16_t *row = wp + k * PANEL;                                                            \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) {                                            \
                const VEC even = CAST(SLLI(ILOAD((const void *)(row + 2 * W * v)), 16));                     \
                _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                          \
                    acc[g][v] = FMA(SET1(x[g * ldx + k]), even, acc[g][v]);                                  \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) STORE(y + g * ldy + W * v, acc[g][v]);      \
    }

#define BF16_512 v16i, v16i_load, v16i_shl, v16i_and, v16i_set1, v16i_bits
#define BF16_256 v8i, v8i_load, v8i_shl, v8i_and, v8i_set1, v8i_bits

#define TILES1(NAME, WT, WLOAD, TARGET, OPS, G) EXPAND(DEFINE_TILE1, NAME, WT, WLOAD, TARGET, OPS, G)
#define TILES2(NAME, INT, TARGET, OPS, G) EXPAND(DEFINE_TILE2, NAME, INT, TARGET, OPS, G)
#define TILES512(G)                                                                                      \
    TILES1(f32_512, float, v16_load, TARGET512, AVX512_VEC, G)                                           \
    TILES1(f16_512, uint16_t, f16x16, TARGET512, AVX512_VEC, G)                                          \
    TILES2(bf16_512, BF16_512, TARGET512, AVX512_VEC, G)
#define TILES256(G)                                                                                      \
    TILES1(f32_256, float, v8_load, , AVX2_VEC, G)                                                       \
    TILES1(f16_256, uint16_t, f16x8, , AVX2_VEC, G)                                                      \
    TILES2(bf16_256, BF16_256, , AVX2_VEC, G)
TILES512(1) TILES512(2) TILES512(3) TILES512(4) TILES512(5) TILES512(6)
TILES256(1) TILES256(2)

typedef void (*tile_fn)(const float *, int64_t, const void *, int64_t, int64_t, float *, int64_t, int, int64_t);
typedef struct {
    int rows, width;      /* a tile's most rows, and its columns (PANEL, or half a panel on AVX2) */
    tile_fn tile[7];      /* by rows */
} tile_set;
#define SET512(T) {6, 64, {0, (tile_fn)T##_512_1, (tile_fn)T##_512_2, (tile_fn)T##_512_3, (tile_fn)T##_512_4, \
                           (tile_fn)T##_512_5, (tile_fn)T##_512_6}}
#define SET256(T) {2, 32, {0, (tile_fn)T##_256_1, (tile_fn)T##_256_2}}
/* by HS_WEIGHT_TYPE (HS_BF16_COMPUTE has its own tiles below), then AVX2 / AVX-512 */
static const tile_set TILES[3][2] = {{SET256(f32), SET512(f32)}, {SET256(bf16), SET512(bf16)},
                                     {SET256(f16), SET512(f16)}};

/* -- bfloat16 compute (AVX512-BF16): x rounded to bfloat16 pairs, dpbf16 into float32 sums ---------- */

/* y[0:G, 0:64] (first: =, else +=) the G rows of rounded pairs at xp (ldp apart), pairs j0 … j1 - 1,
 * by the panel at wp */
#define DEFINE_DOT_TILE(G)                                                                                 \
    TARGET_BF16 static void dot_##G(const uint32_t *xp, int64_t ldp, const uint16_t *wp, int64_t j0,      \
                                    int64_t j1, float *y, int64_t ldy, int first, int64_t ahead) {        \
        v16 acc[G][4];                                                                                    \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                           \
                acc[g][v] = first ? v16_zero() : v16_load(y + g * ldy + 16 * v);                          \
        for (int64_t j = j0; j < j1; ++j) {                                                               \
            const uint16_t *row = wp + 2 * j * PANEL;                                                     \
            if (ahead) PREFETCH_ROW(row + 2 * ahead * PANEL, 2 * PANEL * (int)sizeof(uint16_t));          \
            v16i b[4];                                                                                    \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) b[v] = v16i_load(row + 32 * v);           \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                         \
                const v16bh a = v16bh_set1((int)xp[g * ldp + j]);                                         \
                _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)                                       \
                    acc[g][v] = v16_dot_bf16(acc[g][v], a, b[v]);                                         \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v) v16_store(y + g * ldy + 16 * v, acc[g][v]); \
    }
DEFINE_DOT_TILE(1)
DEFINE_DOT_TILE(2)
DEFINE_DOT_TILE(3)
DEFINE_DOT_TILE(4)
DEFINE_DOT_TILE(5)
DEFINE_DOT_TILE(6)
static const tile_set DOT_TILES = {6, 64, {0, (tile_fn)dot_1, (tile_fn)dot_2, (tile_fn)dot_3, (tile_fn)dot_4,
                                           (tile_fn)dot_5, (tile_fn)dot_6}};

/* x[0:M] (rows ldx apart) as dpbf16 takes it: xp[m·Kr + j] = bf16(x[m][2j]) | bf16(x[m][2j + 1]) << 16
 * (0 past K), rounded once per product call for every thread's columns */
void hs_round_pairs(const float *x, int64_t ldx, int64_t M, int64_t K, uint32_t *xp) {
    const int64_t Kr = (K + 1) / 2;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < Kr; ++j)
            xp[m * Kr + j] = bf16_pair(x + m * ldx, j, K);
}

/* -- the driver ------------------------------------------------------------------------------- */

/* Columns c0 <= n < c1 (c0 a multiple of PANEL) of x @ w into y (rows ldy floats apart, y[0] the
 * row's column c0); w untagged, `type` its HS_WEIGHT_TYPE bits; for HS_BF16_COMPUTE, xp is x's rows
 * as `hs_round_pairs` gives them (x is not read) */
void hs_panel_columns(const float *x, int64_t ldx, const uint32_t *xp, const void *w, int type, int64_t M,
                      int64_t K, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    const int dot = type == HS_BF16_COMPUTE, R = type == HS_BF16_WEIGHT || dot ? 2 : 1;
    const tile_set *t = dot ? &DOT_TILES : &TILES[type][hs_rows_isa(-1)];
    const size_t size = type == HS_F16_WEIGHT || R == 2 ? 2 : 4;  /* bytes per weight */
    const int64_t Kr = (K + R - 1) / R, panel_bytes = Kr * PANEL * R * (int64_t)size;
    /* the tiles' rows (4 bytes each: x's floats, or the rounded pairs) and their index's end */
    const char *rows = dot ? (const char *)xp : (const char *)x;
    const int64_t ld = dot ? Kr : ldx, k_end = dot ? Kr : K, block = dot ? BLOCK_K / 2 : BLOCK_K;
    float scratch[CHUNK_ROWS * PANEL] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = m0 + CHUNK_ROWS < M ? m0 + CHUNK_ROWS : M, groups = (m1 - m0 + t->rows - 1) / t->rows;
        for (int64_t n0 = c0; n0 < c1; n0 += PANEL) {
            const char *panel = (const char *)w + n0 / PANEL * panel_bytes;
            const int whole = c1 - n0 >= PANEL;
            float *yp = whole ? y + m0 * ldy + (n0 - c0) : scratch;
            const int64_t ldp = whole ? ldy : PANEL;
            const int stream = panel_bytes <= STREAM_PANEL_BYTES;
            const int64_t step = stream ? k_end : block;
            for (int64_t k0 = 0; k0 < k_end; k0 += step) {
                const int64_t k1 = k0 + step < k_end ? k0 + step : k_end;
                for (int64_t group = 0; group < groups; ++group) {
                    const int64_t g0 = m0 + (m1 - m0) * group / groups, g1 = m0 + (m1 - m0) * (group + 1) / groups;
                    /* the first group streams the panel (the others read it from L2), or fetches the next block */
                    const int64_t ahead = group > 0 ? 0 : stream ? PREFETCH_ROWS : dot ? block : block / R;
                    for (int s = 0; s < PANEL; s += t->width)
                        t->tile[g1 - g0]((const float *)(rows + g0 * ld * 4), ld,
                                         panel + (int64_t)s * R * (int64_t)size, k0, k1, yp + (g0 - m0) * ldp + s,
                                         ldp, k0 == 0, ahead);
                }
            }
            if (!whole)
                for (int64_t m = m0; m < m1; ++m)
                    memcpy(y + m * ldy + (n0 - c0), scratch + (m - m0) * PANEL, (size_t)(c1 - n0) * sizeof(float));
        }
    }
}
