/* Quantized matrix products on x86 CPUs (AVX2 + FMA; AVX512-VNNI's dot product where present):
 * y[M, N] = x[M, K] @ Wᵀ, W [N, K] in GGUF's Q8_0, Q4_0 or Q4_K blocks (`kernels/quant/formats.py`),
 * each row of W its blocks back to back, as a GGUF tensor lies (or interleaved, HS_X16: Q4_K's by 16
 * rows, below; Q6_K's in two planes of 16-row tiles, quant_q6k.h). Built by `cpu/native.py`, used
 * through `cpu/quant.py`; `hs_quant_top` (the end of this file) gives a Q6_K product's argmax, coarse
 * to exact, for a greedy draft's LM head.
 *
 * Activations, as llama.cpp multiplies them: each row of x is quantized once per call to int8 blocks
 * with a float32 scale (`quantize_rows`; Q8_0 / Q4_0 weights: blocks of 32, Q4_K: blocks of 256 as
 * ggml's Q8_K), and each block of the weight meets its block of x in an integer dot product,
 * exact. Per output (row m, column n) the float work is one fixed chain:
 * - Q8_0: per weight block b in order, its 8 integer lane sums (lane i: bytes 4i … 4i + 3 of the
 *   block) converted exactly to float and fused-multiply-added, times dw_b · dx_b rounded to
 *   float32, into two sets of 8 float32 lanes starting at zero, the even blocks' and the odd
 *   blocks', added lane by lane at the end; then the lanes summed as `hsum8` sums them.
 * - Q4_0: per weight block b in order, the block's whole integer sum Σ (q − 8) · x converted
 *   exactly to float and fused-multiply-added, times dw_b · dx_b rounded to float32, into one of two
 *   float32 sums starting at zero, the even blocks' and the odd blocks'; then those two added. One
 *   sum per output is what lets a tile hold 8 columns in the lanes of one vector: a block's float
 *   work is then one multiply-add for 8 outputs (quant_q4_0.h's tile_q4).
 * - Q4_K: per super-block b in order, its whole integer sum Σ_s scale_s · Σ q · x over the 8
 *   sub-blocks converted to float (exactly below 2^24, else rounded to nearest) and
 *   fused-multiply-added, times d_b · dx_b rounded to float32, into one float32 sum starting at
 *   zero; the mins' part, Σ_s min_s · Σ x likewise times dmin_b · dx_b, into a second; the output
 *   the first less the second. One sum per output again: the AVX512-VNNI tiles hold 16 columns in
 *   the lanes (quant_q4k.h's k16 tiles; one row of a plain weight a column at a time), the AVX2
 *   ones 8 where the weight is interleaved (k8; plain weights a column at a time).
 * Nothing in the chain depends on the other rows of the call, the thread count or the tile that
 * computed it (rows by columns, its shape chosen per ISA, format and row count: AVX2 few rows one
 * column at a time, more in tiles of up to 4 × 2; AVX512-VNNI tiles of up to 6 × 2 from one row,
 * Q8_0's of up to 2 rows two blocks per 512-bit instruction, the two chains in its two halves,
 * Q4_K's one row four sub-blocks per 512-bit instruction, more by 16 columns; Q4_0 tiles of up to
 * Q4_ROWS rows by 8 columns, by 16 in 512-bit vectors on AVX512-VNNI),
 * nor on the ISA (the integer sums are exact on both paths, however each computes them), so a row's
 * bits are the same in any batch, at any thread count, on either path:
 * tests/kernels/quant/test_products.py. The scale products dw_b · dx_b are computed in vectors,
 * each lane rounded as the one product alone. */
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
    const int32_t *xs;  /* [M, K / 32], the sums of each 32 of xq (Q4_0's offset) */
    const int16_t *xs16; /* Q4_K: [M, K / 32], the same as int16 (`k_sums16`), the mins' part */
    const int32_t *xo;  /* Q6_K: xq's −32 offsets as the path takes them, [M, K / 4] int32 at most (quant_q6k.h's q6_offsets) */
    float *y;           /* [M, N] */
    int64_t M, K, N, row_bytes;
    int fmt;
    int x16; /* HS_X16: Q4_K's rows interleaved by X16_ROWS, Q6_K's in two planes (quant_q6k.h) */
    int coarse; /* Q6_K: the coarse pass's sums (`hs_quant_top`), not the product's */
} quant_job;

/* Interleaved weights (HS_X16, `QuantWeight.interleave_`; Q4_K): each X16_ROWS rows' super-block b lies
 * at b · 16 · 144 from the group's first row as its 16 blocks' 36 32-bit words transposed (word i of
 * the 16 rows side by side, 64 bytes, then word i + 1): what the 16-column tiles would otherwise
 * transpose as they read it (quant_q4k.h), in the same bytes. AVX2's k8 tiles read half of each
 * 64-byte word vector, 8 rows in their 8 lanes. */
#define X16_ROWS 16

static inline uint16_t half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

/* a Q4_0 block of 8 weight rows decoded for the tiles by columns (quant_q4_0.h's decode_q4) */
typedef struct {
    v8i q[8]; /* lane c: 4 values of row c, 0..15 */
    v8 dw;    /* lane c: row c's scale */
} q4_cols;
#define Q4_DECODED 576 /* the bytes a decoded block takes in the tiles' cache: the most of q4_cols (AVX2) and
                        * quant_q4_0.h's q4_cols16 (16 columns, AVX512-VNNI) */

/* the `count` weight rows of a tile of columns n0 … n0 + count − 1 (columns past the first C: the
 * last one again; the tiles by columns hold 8 or 16) */
static inline void tile_rows(const quant_job *j, int64_t n0, int C, int count, const uint8_t **row) {
    for (int c = 0; c < count; ++c) row[c] = j->w + (n0 + (c < C ? c : C - 1)) * j->row_bytes;
}

/* block b (`bytes` each) of a 16-column tile's rows row[0] … row[15] (the 16-column tiles of
 * quant_q4k.h and quant_q6k.h on weights in GGUF's order), and the prefetch of the next tile's rows (16 on, into L1) and the
 * one after (into L2), their share of block b's bytes: the tiles read the weight in order */
static inline __attribute__((always_inline)) void tile16_blocks(const quant_job *j, const uint8_t *const row[16],
                                                                int64_t b, int64_t bytes, const uint8_t *blk[16]) {
    for (int c = 0; c < 16; ++c) blk[c] = row[c] + b * bytes;
    const int64_t share = 16 * bytes;
    const uint8_t *ahead = row[0] + 16 * j->row_bytes + b * share, *further = row[0] + 32 * j->row_bytes + b * share;
    for (int64_t line = 0; line < share; line += 64) prefetch_l1(ahead + line), prefetch_l2(further + line);
}

/* A block's dot product, each ISA's way to the same exact integers (the includer's part of
 * quant_tiles.h): QWEIGHT_OFFSET (−128 · a Q8_0 weight block's lane sums, where the dot product
 * takes the activations 128 higher, unsigned; else zero), QACT (the activations as the dot product
 * takes them), QDOT (a Q8_0 block's 8 lane sums of weights times activations), QDOT4 (acc plus, per
 * lane, 4 nibbles 0..15 by 4 int8 activations: Q4_0's tiles by columns) and Q4_ROWS (the most rows
 * of one of those tiles). Q4_K's tile is AVX2's in 256-bit vectors, or with QWIDE_K, AVX512-VNNI's
 * in 512-bit ones (quant_q4k.h). */
/* AVX2: Q8_0 signed by signed (maddubs takes unsigned × signed: the signs moved onto x), nibbles
 * by x in 16-bit pairs */
#define QS(name) name##_avx2
#define QTARGET
#define FEW_ROWS 4  /* 16 vector registers */
#define TILE_ROWS 4
#define TILE_COLS 2
#define Q4_ROWS 2
#define QWEIGHT_OFFSET(w) v8i_zero()
#define QACT(x) (x)
#define QDOT(w, wo, x) dot_s8_lanes(w, x)
#define QDOT4(acc, u, x) dot_u4_lanes_acc(acc, u, x)
#include "quant_tiles.h"
#undef QS
#undef QTARGET
#undef FEW_ROWS
#undef TILE_ROWS
#undef TILE_COLS
#undef Q4_ROWS
#undef QWEIGHT_OFFSET
#undef QACT
#undef QDOT
#undef QDOT4
/* AVX512-VNNI: dpbusd, unsigned by signed. Q8_0: the activations 128 higher (x ^ 0x80) by the
 * weights, from −128 · the weights' lane sums (up to QWIDE rows two blocks per 512-bit dpbusd);
 * Q4_0: the nibbles by x */
#define QS(name) name##_vnni
#define QTARGET TARGET_VNNI
#define FEW_ROWS 0  /* none: one row too in tiles of two columns; 32 vector registers */
#define TILE_ROWS 6
#define TILE_COLS 2
#define Q4_ROWS 6
#define QWIDE 2 /* Q8_0 tiles of up to this many rows: two blocks per 512-bit dpbusd (quant_tiles.h) */
#define QWEIGHT_OFFSET(w) neg_dot_lanes_vnni(128, w)
#define QACT(x) i8x32_offset(x)
#define QDOT(w, wo, x) dot_u8_lanes_vnni(wo, x, w)
#define QDOT4(acc, u, x) dot_u8_lanes_vnni(acc, u, x)
#define QWIDE_K /* Q4_K in 512-bit vectors (quant_q4k.h): up to K_COLUMN_ROWS rows a column at a time, the
                 * activations as k_pair_activations lays them; more rows 16 columns in the lanes */
#define K_COLUMN_ROWS 1
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

/* quantize_rows over the threads for many rows (a prefill's): rows are independent, so the bits do not
 * depend on the split */
#define QUANTIZE_MIN_FLOATS (1 << 18) /* x's floats below which one thread quantizes */
typedef struct {
    const float *x;
    int64_t ldx, M, K, block;
    int8_t *q;
    float *d;
    int32_t *s;
} quantize_job;

static void quantize_part(void *ctx, int part, int parts) {
    const quantize_job *j = ctx;
    const int64_t m0 = j->M * part / parts, m1 = j->M * (part + 1) / parts;
    quantize_rows(j->x + m0 * j->ldx, j->ldx, m1 - m0, j->K, j->block, j->q + m0 * j->K, j->d + m0 * (j->K / j->block),
                  j->s + m0 * (j->K / 32));
}

/* Q4_K: the activations' sums of 32 s [n] as int16 s16 (|s| <= 32 · 127), 8 a super-block: the
 * mins' part Σ m_j · s_j of a super-block is then one 16-bit multiply-add (the same integer) */
static void k_sums16(const int32_t *s, int64_t n, int16_t *s16) {
    for (int64_t i = 0; i < n; ++i) s16[i] = (int16_t)s[i];
}

/* Q4_K on AVX512-VNNI's 512-bit tiles: each row's int8 activations q [n] with sub-blocks 1 and 2, 5 and 6
 * of each 256 swapped (0 2 1 3 4 6 5 7), so 64 bytes hold the activations of the low nibbles of two
 * 32-byte chunks of weights (sub-blocks 4i and 4i + 2) and the next 64 those of the high nibbles */
static void k_pair_activations(int8_t *q, int64_t n) {
    for (int64_t i = 0; i < n; i += 128) {
        int8_t t[32];
        memcpy(t, q + i + 32, 32);
        memcpy(q + i + 32, q + i + 64, 32);
        memcpy(q + i + 64, t, 32);
    }
}

/* columns c0 … c1 − 1 on the path in use */
static void plain_columns(const quant_job *j, int64_t c0, int64_t c1) {
    if (j->fmt == HS_Q6_K) q6_columns(j, c0, c1, vnni == 1, j->coarse);
    else if (vnni == 1) columns_vnni(j, c0, c1);
    else columns_avx2(j, c0, c1);
}

/* part `part` of `parts`: its share of the columns, in chunks of 16 */
static void quant_part(void *ctx, int part, int parts) {
    const quant_job *j = ctx;
    const int64_t chunks = (j->N + 15) / 16;
    const int64_t c0 = chunks * part / parts * 16, c1 = part + 1 == parts ? j->N : chunks * (part + 1) / parts * 16;
    if (c0 >= c1) return;
    plain_columns(j, c0, c1);
}

/* the job's columns over the threads where it is big enough, else on the caller */
static void run_job(quant_job *job) {
    const int64_t work = job->M * job->N * (job->K / 32);
    const int threads = hs_threads(), widest = (int)((job->N + 15) / 16);
    const int parts = work < PARALLEL_MIN_BLOCKS ? 1 : threads < widest ? threads : widest;
    if (!(parts > 1 && (work >= (1 << 22) ? hs_parallel_long : hs_parallel)(quant_part, job, parts)))
        quant_part(job, 0, 1);
}

/* y[M, N] = x[M, K] @ w[N, K]ᵀ, w in format `fmt` (HS_Q8_0, HS_Q4_0, HS_Q4_K, HS_Q6_K); K a multiple of the
 * format's block. Returns 0, or -1 for arguments it does not take (checked before anything is
 * computed) or no memory for the rounded activations. */
int hs_quant_matmul(const float *x, int64_t ldx, const uint8_t *w, int fmt, int64_t M, int64_t K, int64_t N,
                    float *y) {
    const int x16 = (fmt & HS_X16) != 0;
    fmt &= ~HS_X16;
    if (x16 && ((fmt != HS_Q4_K && fmt != HS_Q6_K) || N % X16_ROWS)) return -1;
    const int64_t block = fmt >= HS_Q4_K ? 256 : 32;
    const int64_t bytes = fmt == HS_Q6_K ? Q6_BYTES : fmt == HS_Q4_K ? 144 : fmt == HS_Q4_0 ? 18 : 34;
    if (fmt < HS_Q8_0 || fmt > HS_Q6_K || M < 0 || K < 0 || N < 0 || K % block || (M > 1 && ldx < K)) return -1;
    if (M == 0 || N == 0) return 0;
    if (vnni < 0) hs_quant_isa(-1);
    /* one allocation: s [M, K / 32] int32, d [M, K / block] float, q [M, K] int8, Q4_K: s16 [M, K / 32] */
    const size_t n_s = (size_t)(M * (K / 32)), n_d = (size_t)(M * (K / block));
    const size_t n_s16 = fmt == HS_Q4_K ? n_s : 0;
    int32_t *s = malloc(n_s * sizeof(int32_t) + n_d * sizeof(float) + (size_t)(M * K) + n_s16 * sizeof(int16_t) + 64);
    if (!s) return -1;
    float *d = (float *)(s + n_s);
    int8_t *q = (int8_t *)(d + n_d);
    int16_t *s16 = (int16_t *)(q + M * K);
    quantize_job quantize = {x, ldx, M, K, block, q, d, s};
    if (!hs_parallel_units(quantize_part, &quantize, M, M * K, QUANTIZE_MIN_FLOATS)) quantize_part(&quantize, 0, 1);
    k_sums16(s, (int64_t)n_s16, s16);
    if (fmt == HS_Q4_K && vnni == 1 && M <= K_COLUMN_ROWS && !x16) k_pair_activations(q, M * K);

    int32_t *xo = fmt == HS_Q6_K ? malloc((size_t)(M * K)) : NULL;
    if (fmt == HS_Q6_K && !xo) {
        free(s);
        return -1;
    }
    if (xo) q6_offsets(q, M, K, vnni == 1, M <= Q6_COLUMN_ROWS && !x16, -32, xo);
    quant_job job = {w, q, d, s, s16, xo, y, M, K, N, K / block * bytes, fmt, x16, 0};
    run_job(&job);
    free(xo);
    free(s);
    return 0;
}

/* -- The argmax of a Q6_K product's rows, coarse to exact (a greedy draft's LM head, `cpu/forward.c`) --
 * A coarse pass scores every column by the high plane alone: per super-block the exact integer
 * Σ_j sc_j · Σ (2h − 3) · x, h the value's two high bits (its 6 bits' top two, the low nibble taken
 * as its middle: 16h + 8 − 32 = 8 (2h − 3)), in the product's float chain (times d_b · dx_b into one
 * float32 sum), the same integers and floats on either path. Each row's `top` best columns by that
 * score (the lower column first among equals) then get the product's own outputs, the bits
 * `hs_quant_matmul` gives them, and every other column −∞: the argmax of the row is the product's
 * wherever the product's best column is among them. On interleaved weights (HS_X16: two planes,
 * quant_q6k.h) the coarse pass reads 82 of each super-block's 210 bytes, 16 columns in the lanes. */

/* heap[0 … size) a min-heap of columns by (score, −column): the worst kept column at the root */
static int worse(const float *score, int64_t a, int64_t b) {
    return score[a] < score[b] || (score[a] == score[b] && a > b);
}
static void sift_down(int64_t *heap, int64_t size, int64_t at, const float *score) {
    for (;;) {
        int64_t least = at, l = 2 * at + 1, r = l + 1;
        if (l < size && worse(score, heap[l], heap[least])) least = l;
        if (r < size && worse(score, heap[r], heap[least])) least = r;
        if (least == at) return;
        const int64_t t = heap[at];
        heap[at] = heap[least], heap[least] = t, at = least;
    }
}

/* the `top` best columns of score [N] (NaN scores taken as −∞ beforehand), into heap */
static void best_columns(const float *score, int64_t N, int64_t top, int64_t *heap) {
    for (int64_t n = 0; n < top; ++n) heap[n] = n;
    for (int64_t at = top / 2; at-- > 0;) sift_down(heap, top, at, score);
    for (int64_t n = top; n < N; ++n)
        if (worse(score, heap[0], n)) heap[0] = n, sift_down(heap, top, 0, score);
}

/* y[M, N]: each row's `top` best columns by the coarse pass (`top` at most N) with the product's
 * outputs, the others −∞; best[m] (where not NULL) the row's argmax, the first of equals. w in Q6_K
 * (HS_Q6_K, or with HS_X16 interleaved, the rows a multiple of 16); K a multiple of 256. Returns 0, 1 where a kept output is not
 * finite, or -1 for arguments it does not take (checked before anything is computed) or no memory. */
int hs_quant_top(const float *x, int64_t ldx, const uint8_t *w, int fmt, int64_t M, int64_t K, int64_t N,
                 int64_t top, float *y, int64_t *best) {
    const int x16 = (fmt & HS_X16) != 0;
    fmt &= ~HS_X16;
    if (fmt != HS_Q6_K || M < 1 || K < 256 || K % 256 || N < 1 || top < 1 || (M > 1 && ldx < K)
        || (x16 && N % X16_ROWS)) return -1;
    if (top > N) top = N;
    if (vnni < 0) hs_quant_isa(-1);
    /* one allocation: s [M, K / 32] int32, the offsets of the coarse pass and of the product [M, K / 4]
     * int32 each, d [M, K / 256] float, the scores [M, N] float, the heap [top], q [M, K] int8 */
    const size_t n_s = (size_t)(M * (K / 32)), n_o = (size_t)(M * (K / 4)), n_d = (size_t)(M * (K / 256));
    int32_t *s = malloc((n_s + 2 * n_o) * sizeof(int32_t) + (n_d + (size_t)(M * N)) * sizeof(float)
                        + (size_t)top * sizeof(int64_t) + (size_t)(M * K));
    if (!s) return -1;
    int32_t *coarse_offsets = s + n_s, *offsets = coarse_offsets + n_o;
    float *d = (float *)(offsets + n_o), *score = d + n_d;
    int64_t *heap = (int64_t *)(score + M * N);
    int8_t *q = (int8_t *)(heap + top);
    quantize_rows(x, ldx, M, K, 256, q, d, s);
    q6_offsets(q, M, K, vnni == 1, !(vnni == 1 && x16), -3, coarse_offsets); /* the layout its tiles take */
    if (vnni == 1) q6_offsets(q, M, K, 1, 1, -32, offsets);
    else offsets = coarse_offsets; /* AVX2's are the sums of x alone (the decoded scales carry the −3, −32) */
    quant_job job = {w, q, d, s, NULL, coarse_offsets, score, M, K, N, K / 256 * Q6_BYTES, HS_Q6_K, x16, 1};
    run_job(&job);
    job.xo = offsets, job.y = y, job.coarse = 0;
    int status = 0;
    for (int64_t m = 0; m < M; ++m) {
        float *row = score + m * N, *out = y + m * N;
        for (int64_t n = 0; n < N; ++n) {
            if (row[n] != row[n]) row[n] = -INFINITY;
            out[n] = -INFINITY;
        }
        best_columns(row, N, top, heap);
        int64_t argmax = -1;
        for (int64_t i = 0; i < top; ++i) { /* each kept column's output, as the product's tiles give it */
            const int64_t n = heap[i];
            if (vnni == 1) q6_tile_vnni_sized(&job, m, 1, n, 1, 1, 0);
            else q6_tile_avx2_sized(&job, m, 1, n, 1, 1, 0);
            if (!isfinite(out[n])) status = 1;
            else if (argmax < 0 || out[n] > out[argmax] || (out[n] == out[argmax] && n < argmax)) argmax = n;
        }
        if (best) best[m] = argmax < 0 ? heap[0] : argmax;
    }
    free(s);
    return status;
}
