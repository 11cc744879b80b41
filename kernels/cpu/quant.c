/* Quantized matrix products on x86 CPUs (AVX2 + FMA; AVX512-VNNI's dot product where present):
 * y[M, N] = x[M, K] @ Wᵀ, W [N, K] in GGUF's Q8_0, Q4_0 or Q4_K blocks (`kernels/quant/formats.py`),
 * each row of W its blocks back to back, as a GGUF tensor lies. Built by `cpu/native.py`, used
 * through `cpu/quant.py`.
 *
 * Activations, as llama.cpp multiplies them: each row of x is quantized once per call to int8 blocks
 * with a float32 scale (`quantize_rows`; Q8_0 / Q4_0 weights: blocks of 32, Q4_K: blocks of 256 as
 * ggml's Q8_K), and each block of the weight meets its block of x in an integer dot product,
 * exact. Per output (row m, column n) the float work is one fixed chain: per weight block b in
 * order, its 8 integer lane sums (lane i: bytes 4i … 4i + 3 of the block) converted exactly to
 * float and fused-multiply-added, times dw_b · dx_b rounded to float32, into 8 float32 lanes
 * starting at zero (Q8_0 and Q4_0: two sets of lanes, the even blocks' and the odd blocks', added
 * lane by lane at the end); then the lanes summed as `hsum8` sums them (Q4_K: minus a float chain
 * of the mins' part). Nothing in the chain depends on the other rows of the call, the thread count or the
 * tile that computed it (rows by columns, its shape chosen per ISA and row count: AVX2 few rows one
 * column at a time, more in tiles of up to 4 × 2; AVX512-VNNI tiles of up to 6 × 2 from one row,
 * Q8_0's of up to 2 rows two blocks per 512-bit instruction, the two chains in its two halves),
 * nor on the ISA (the integer sums are exact on both paths, however each computes them), so a
 * row's bits are the same in any batch, at any thread count, on either path:
 * tests/kernels/quant/test_products.py. The scale products dw_b · dx_b are computed 8 blocks at a
 * time in a vector, each lane rounded as the one product alone. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define ACC_ROWS 6     /* the most rows and columns of any tile (each ISA's FEW_ROWS, TILE_ROWS, TILE_COLS) */
#define ACC_COLS 2
#define ROW_CHUNK 64   /* rows whose activations the tiles keep in cache while the columns pass */
#define PARALLEL_MIN_BLOCKS (1 << 12) /* block products below which a call runs on its caller alone */

typedef struct {
    const uint8_t *w;   /* [N, row_bytes] */
    const int8_t *xq;   /* [M, K], the rounded activations */
    const float *xd;    /* [M, K / act_block], their scales */
    const int32_t *xs;  /* [M, K / 32], the sums of each 32 of xq (the Q4_K mins' part) */
    float *y;           /* [M, N] */
    int64_t M, K, N, row_bytes;
    int fmt;
    const int32_t *xo;  /* Q6_K: [M, K / 4], xq's −32 offsets as the path takes them (quant_q6k.h's q6_offsets) */
} quant_job;

static inline uint16_t half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

/* Q4_K's 12 bytes -> the 8 scales and 8 mins (ggml's get_scale_min_k4) */
static inline void k_scales(const uint8_t *q, int sc[8], int mn[8]) {
    for (int i = 0; i < 4; ++i) {
        sc[i] = q[i] & 63;
        mn[i] = q[i + 4] & 63;
        sc[i + 4] = (q[i + 8] & 0x0F) | ((q[i] >> 6) << 4);
        mn[i + 4] = (q[i + 8] >> 4) | ((q[i + 4] >> 6) << 4);
    }
}

/* A block's dot product, each ISA's way to the same exact integers (the includer's part of
 * quant_tiles.h): QWEIGHT_SIDE (whether the offset that makes one operand unsigned is taken out
 * through the weights, once per block and column, or through the activations, once per block and
 * row: for R rows a constant), QWEIGHT (a Q8_0 / Q4_0 block's 32 values as the dot product takes
 * them), QWEIGHT_OFFSET and QACT_OFFSET (what the offset adds to each lane sum, negated: the
 * weights' or the activations' part), QACT (the activations as the dot product takes them), QDOT
 * (the 8 lane sums of values times activations) and QDOT_K (acc plus a Q4_K sub-block's lane sums
 * times its scale). */
/* AVX2: Q8_0 signed by signed (maddubs takes unsigned × signed: the signs moved onto x), Q4_0's
 * nibbles 0..15 by x, plus −8 · x's lane sums */
#define QS(name) name##_avx2
#define QTARGET
#define FEW_ROWS 4  /* 16 vector registers */
#define TILE_ROWS 4
#define TILE_COLS 2
#define QWEIGHT_SIDE(q4, R) 0
#define QWEIGHT(p, q4, side) ((q4) ? u8x32_nibbles16(p) : v8i_load(p))
#define QWEIGHT_OFFSET(w, side) v8i_zero()
#define QACT(x, side) (x)
#define QACT_OFFSET(x, q4, side) ((q4) ? i8x32_lane_sums(x, -8) : v8i_zero())
#define QDOT(w, wo, x, xo, q4, side) ((q4) ? v8i_add(dot_u4_scaled_lanes(w, x, 1), xo) : dot_s8_lanes(w, x))
#define QDOT_K(acc, w, x, scale) v8i_add(acc, dot_u4_scaled_lanes(w, x, scale))
#include "quant_tiles.h"
#undef QS
#undef QTARGET
#undef FEW_ROWS
#undef TILE_ROWS
#undef TILE_COLS
#undef QWEIGHT_SIDE
#undef QWEIGHT
#undef QWEIGHT_OFFSET
#undef QACT
#undef QACT_OFFSET
#undef QDOT
#undef QDOT_K
/* AVX512-VNNI: dpbusd, unsigned by signed (Q8_0 up to QWIDE rows: two blocks per 512-bit one).
 * Through the weights (Q8_0; Q4_0 from 3 rows): the activations 128 higher (x ^ 0x80) by the
 * weights (Q4_0's nibbles less 8), from −128 · the weights' lane sums. Through the activations
 * (Q4_0 below 3 rows, where a column's offset would serve too few rows): the nibbles by x, from
 * −8 · x's lane sums */
#define QS(name) name##_vnni
#define QTARGET TARGET_VNNI
#define FEW_ROWS 0  /* none: one row too in tiles of two columns; 32 vector registers */
#define TILE_ROWS 6
#define TILE_COLS 2
#define QWEIGHT_SIDE(q4, R) (!(q4) || (R) >= 3)
#define QWIDE 2 /* Q8_0 tiles of up to this many rows: two blocks per 512-bit dpbusd (quant_tiles.h) */
#define QWEIGHT(p, q4, side) ((q4) ? ((side) ? i8x32_sub(u8x32_nibbles16(p), 8) : u8x32_nibbles16(p)) : v8i_load(p))
#define QWEIGHT_OFFSET(w, side) ((side) ? neg_dot_lanes_vnni(128, w) : v8i_zero())
#define QACT(x, side) ((side) ? i8x32_offset(x) : (x))
#define QACT_OFFSET(x, q4, side) ((side) ? v8i_zero() : i8x32_lane_sums(x, -8))
#define QDOT(w, wo, x, xo, q4, side) ((side) ? dot_u8_lanes_vnni(wo, x, w) : dot_u8_lanes_vnni(xo, w, x))
#define QDOT_K(acc, w, x, scale) dot_u4_scaled_lanes_vnni(acc, w, x, scale)
#include "quant_tiles.h"

#include "quant_q6k.h" /* Q6_K: its own tiles, each path its own integer sums */

static int vnni = -1; /* the dot product in use: 1 AVX512-VNNI, 0 AVX2, -1 not chosen yet */

/* choice -1: report; 0: AVX2's dot product; 1: AVX512-VNNI's (where the CPU has it). Returns the
 * path in use after the call (0 or 1), or -1 for a choice this CPU cannot take. The first use
 * picks VNNI where there is one. */
int hs_quant_isa(int choice) {
    const int has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    if (choice == 0) vnni = 0;
    else if (choice == 1 && has) vnni = 1;
    else if (choice == 1) return -1;
    else if (vnni < 0) vnni = has;
    return vnni;
}

/* x [M, K] (rows ldx apart) -> q [M, K], d [M, K / block] (d = max|x| / 127, q = roundf(x · (1 / d)):
 * `formats.quantize_rows_q8`) and s [M, K / 32], the sums of each 32 of q. Vectors of 8, each lane
 * as the scalar expressions round it: the same bits. */
static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t block, int8_t *q, float *d,
                          int32_t *s) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K / block; ++b) {
            const float *xb = x + m * ldx + b * block;
            v8 vmax = v8_zero();
            for (int64_t i = 0; i < block; i += 8) vmax = v8_max(v8_abs(v8_load(xb + i)), vmax); /* NaN: skipped */
            const float amax = hmax8(vmax), db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            const v8 vid = v8_set1(id);
            d[m * (K / block) + b] = db;
            for (int64_t i = 0; i < block; i += 32) {
                const v8i qi = i8x32_from_floats(v8_round_half_away(v8_mul(v8_load(xb + i), vid)),
                                                 v8_round_half_away(v8_mul(v8_load(xb + i + 8), vid)),
                                                 v8_round_half_away(v8_mul(v8_load(xb + i + 16), vid)),
                                                 v8_round_half_away(v8_mul(v8_load(xb + i + 24), vid)));
                v8i_store(q + m * K + b * block + i, qi);
                s[m * (K / 32) + (b * block + i) / 32] = v8i_hsum(i8x32_lane_sums(qi, 1));
            }
        }
}

/* part `part` of `parts`: its share of the columns, in chunks of 16 */
static void quant_part(void *ctx, int part, int parts) {
    const quant_job *j = ctx;
    const int64_t chunks = (j->N + 15) / 16;
    const int64_t c0 = chunks * part / parts * 16, c1 = part + 1 == parts ? j->N : chunks * (part + 1) / parts * 16;
    if (c0 >= c1) return;
    if (j->fmt == HS_Q6_K) q6_columns(j, c0, c1, vnni == 1);
    else if (vnni == 1) columns_vnni(j, c0, c1);
    else columns_avx2(j, c0, c1);
}

/* y[M, N] = x[M, K] @ w[N, K]ᵀ, w in format `fmt` (HS_Q8_0, HS_Q4_0, HS_Q4_K, HS_Q6_K); K a multiple of the
 * format's block. Returns 0, or -1 for arguments it does not take (checked before anything is
 * computed) or no memory for the rounded activations. */
int hs_quant_matmul(const float *x, int64_t ldx, const uint8_t *w, int fmt, int64_t M, int64_t K, int64_t N,
                    float *y) {
    const int64_t block = fmt >= HS_Q4_K ? 256 : 32;
    const int64_t bytes = fmt == HS_Q6_K ? Q6_BYTES : fmt == HS_Q4_K ? 144 : fmt == HS_Q4_0 ? 18 : 34;
    if (fmt < HS_Q8_0 || fmt > HS_Q6_K || M < 0 || K < 0 || N < 0 || K % block || (M > 1 && ldx < K)) return -1;
    if (M == 0 || N == 0) return 0;
    if (vnni < 0) hs_quant_isa(-1);
    /* one allocation: s [M, K / 32] int32, d [M, K / block] float, q [M, K] int8 */
    const size_t n_s = (size_t)(M * (K / 32)), n_d = (size_t)(M * (K / block));
    int32_t *s = malloc(n_s * sizeof(int32_t) + n_d * sizeof(float) + (size_t)(M * K) + 64);
    if (!s) return -1;
    float *d = (float *)(s + n_s);
    int8_t *q = (int8_t *)(d + n_d);
    quantize_rows(x, ldx, M, K, block, q, d, s);
    quant_job job = {w, q, d, s, y, M, K, N, K / block * bytes, fmt};
    int32_t *xo = fmt == HS_Q6_K ? malloc((size_t)(M * K)) : NULL;
    if (fmt == HS_Q6_K && !xo) {
        free(s);
        return -1;
    }
    if (xo) q6_offsets(q, M, K, vnni == 1, xo);
    job.xo = xo;
    const int64_t work = M * N * (K / 32);
    const int threads = hs_threads(), widest = (int)((N + 15) / 16);
    const int parts = work < PARALLEL_MIN_BLOCKS ? 1 : threads < widest ? threads : widest;
    if (!(parts > 1 && (work >= (1 << 22) ? hs_parallel_long : hs_parallel)(quant_part, &job, parts)))
        quant_part(&job, 0, 1);
    free(xo);
    free(s);
    return 0;
}
