/* Few-row matrix products on x86 CPUs with AVX2 and FMA (AVX-512 where present): y = x @ w.
 *
 * x is [M, K] (rows `ldx` floats apart, unit column stride), w is [K, N]
 * contiguous (input-major: a MoE's experts, a weight not packed), float32
 * or its exact bfloat16 / float16 copy (see "weight storage" below), y is
 * [M, N] contiguous; a weight in panels (what `HybridModel.pack_for_cpu`
 * stores, HS_PANELS) goes to `cpu/panels.c` with the same bits. Built by
 * `cpu/native.py`, used through `cpu/rows.py` (see there for why).
 *
 * The weight is streamed in memory order, Q rows of w at a time, for groups
 * of up to GROUP_ROWS rows of x; the group's G·Q broadcasts of x and the Q
 * weight vectors stay in registers (no spills: G·Q + Q + 1 <= 16 ymm), and
 * each vector of y is loaded and stored once per Q weight rows. The groups
 * take k-blocks of KBLOCK weight rows in turn, so a second group reads the
 * block from cache. Software prefetch fetches the rows PREFETCH_ROWS ahead
 * (past the last row it names memory the kernel never reads; a prefetch
 * does not fault): with the weights out of cache, the extra rows of a
 * verify (γ + 1 inputs) then cost little more than one row, their
 * arithmetic hiding behind the memory.
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
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"
#include <stdlib.h>
#include <string.h>

#define GROUP_ROWS 5     /* rows of x per register group */
#define KBLOCK 12        /* weight rows the groups take in turn (a multiple of every Q) */
/* how far ahead, in weight rows, the stream is prefetched: on weights in huge pages (pack_for_cpu) 2-4
 * rows streamed a decode step's products faster than 6-16 (docs/results/llamacpp.md, "Prefetch distance") */
#define PREFETCH_ROWS 3

/* y[0:G, 0:n1] += x[0:G, k:k+Q] @ w[k:k+Q, 0:n1], n1 a multiple of W (the columns per vector) */
#define DEFINE_STEP(NAME, WT, WLOAD, PER_LINE, TARGET, VEC, W, LOAD, STORE, FMA, SET1, G, Q)              \
    TARGET static void NAME##_##G##_##Q(const float *x, int64_t ldx, const WT *w, int64_t N, int64_t k,  \
                                        int64_t n1, float *y, int64_t ldy) {                            \
        VEC b[G][Q];                                                                                    \
        _Pragma("GCC unroll 12") for (int g = 0; g < G; ++g)                                            \
            _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q) b[g][q] = SET1(x[g * ldx + k + q]);    \
        const WT *wk = w + k * N;                                                                       \
        for (int64_t n = 0; n < n1; n += W) {                                                           \
            if ((n & (PER_LINE - 1)) == 0) /* one prefetch per cache line of each row */                \
                _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q)                                    \
                    prefetch_l1(wk + (PREFETCH_ROWS + q) * N + n);                                      \
            VEC a[Q];                                                                                   \
            _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q) a[q] = WLOAD(wk + q * N + n);           \
            _Pragma("GCC unroll 12") for (int g = 0; g < G; ++g) {                                      \
                float *out = y + g * ldy + n;                                                           \
                VEC acc = LOAD(out);                                                                    \
                _Pragma("GCC unroll 12") for (int q = 0; q < Q; ++q) acc = FMA(b[g][q], a[q], acc);     \
                STORE(out, acc);                                                                        \
            }                                                                                           \
        }                                                                                               \
    }

#define AVX2_OPS v8, 8, v8_load, v8_store, v8_fmadd, v8_set1
#define AVX512_OPS v16, 16, v16_load, v16_store, v16_fmadd, v16_set1
#define EXPAND(MACRO, ...) MACRO(__VA_ARGS__)  /* the _OPS lists expanded into arguments first */
static int isa512 = -1; /* the vectors in use: 1 AVX-512, 0 AVX2, -1 not chosen yet (hs_rows_isa) */

/* choice -1: report; 0: the AVX2 steps; 1: the AVX-512 steps (where the CPU has
 * AVX-512F). Returns the path in use after the call (0 or 1), or -1 for a
 * choice this CPU cannot take. The first use picks AVX-512 where there is one. */
int hs_rows_isa(int choice) {
    const int has512 = __builtin_cpu_supports("avx512f") != 0;
    if (choice == 0) isa512 = 0;
    else if (choice == 1 && has512) isa512 = 1;
    else if (choice == 1) return -1;
    else if (isa512 < 0) isa512 = has512;
    return isa512;
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
 * block, 16 KiB, in L1), the tile calls prefetching the next block into L2, a share each. A weight
 * streamed from memory (past L2) multiplied by fewer than TILE_K_LONG_ROWS rows takes blocks of
 * TILE_K_STREAMED instead, and below AHEAD_MAX_ROWS rows each tile prefetches, weight row by weight
 * row, the next panel's part of the row into L1 instead of the next block: a block's rows are then
 * 16 (or 64) sequential streams, each fetched one panel ahead, which keeps the memory busy while
 * the tiles compute; with more rows the arithmetic bounds the product, and the longer blocks' fewer
 * loads and stores of the sums and the block prefetch win back: against blocks of TILE_K with the
 * next block prefetched for every row count, this is faster from 6 to 30 rows and even at 40, and
 * from 60 rows the block prefetch is the faster, so those rows keep it (figures:
 * docs/results/code_notes.md). */
#define TILE_K 64
#define TILE_K_STREAMED 16
#define TILE_K_LONG_ROWS 24
#define AHEAD_MAX_ROWS 40
/* Rows from which the tiles run (fewer: the steps above, as fast or faster). Streamed from memory,
 * 5 rows and up (a verify of batch 1: at 5 rows the tiles are the faster, at 4 the two are even).
 * From cache the tiles win from 10 rows. */
#define TILE_MIN_ROWS 5
#define TILE_MIN_ROWS_CACHED 10
#define CACHED_WEIGHT_BYTES (2 << 20)
/* Widened tiles (16-bit weights, see WIDEN_MIN_GROUPS) streaming their weight from memory take,
 * below TILE_K_LONG_ROWS rows, blocks of TILE_K_WIDENED rows with the next block prefetched, where
 * unwidened ones take TILE_K_STREAMED with each row's next panel (and from 24 rows, blocks of
 * TILE_K with the next block below AHEAD_MAX_ROWS too): a 16-bit weight is half the bytes to
 * fetch, and the longer blocks fewer sums to load and store, which makes 16-bit products of 15 to
 * 30 rows faster than with TILE_K_STREAMED. (`widen` is derived inside tiled_matmul: passed in as
 * an argument it made those products slower.) */
#define TILE_K_WIDENED 32

/* y[0:G, 0:V·W] += x[0:G, k0:k1] @ w[k0:k1, 0:V·W] (W columns per vector), prefetching the
 * `pf_lines` cache lines from `pf` on, a few per weight row, and with `ahead` each weight row's
 * next V·W columns (the next panel's part of the row) */
#define DEFINE_TILE(NAME, WT, WLOAD, PER_LINE, TARGET, VEC, W, LOAD, STORE, FMA, SET1, G, V)               \
    TARGET static void NAME##_##G##_##V(const float *x, int64_t ldx, const WT *w, int64_t N, int64_t k0,   \
                                        int64_t k1, float *y, int64_t ldy, const WT *pf, int64_t pf_lines, \
                                        int ahead) {                                                    \
        VEC acc[G][V];                                                                                  \
        const int64_t pf_per_row = (pf_lines + (k1 - k0) - 1) / (k1 - k0);                             \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[g][v] = LOAD(y + g * ldy + W * v); \
        for (int64_t k = k0; k < k1; ++k) {                                                             \
            const WT *wk = w + k * N;                                                                   \
            for (int64_t l = (k - k0) * pf_per_row; l < (k - k0 + 1) * pf_per_row && l < pf_lines; ++l) \
                prefetch_l2(pf + PER_LINE * l);                                                         \
            VEC b[V];                                                                                   \
            if (ahead)                                                                                  \
                _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) if (W * v % PER_LINE == 0)          \
                    prefetch_l1(wk + W * V + W * v);                                                    \
            _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) b[v] = WLOAD(wk + W * v);              \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                       \
                const VEC a = SET1(x[g * ldx + k]);                                                     \
                _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[g][v] = FMA(a, b[v], acc[g][v]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) STORE(y + g * ldy + W * v, acc[g][v]);  \
    }

/* `tiled_matmul` (cpu/rows_weights.h): y (zeroed) += x @ w with the tiles: blocks of `tile_k` weight rows, then
 * panels of columns, then row groups. A block's rows are contiguous in
 * memory; while one block is multiplied, the tile calls prefetch the next one
 * in memory order (each call a share, a line or two per weight row; with
 * `ahead`, each tile the next panel's part of its weight rows instead: see
 * TILE_K_STREAMED above), so the
 * weight streams from memory behind the arithmetic (a panel-major order reads
 * 256 bytes of each of 128 rows far apart, which no hardware prefetcher
 * follows). The tiles read the block where it lies, whatever N: copying a
 * panel's part of a block first (where rows lie a multiple of 4 KiB apart
 * and crowd into a few cache sets) was slower from 10 to 80 rows on weights
 * in huge pages, where `pack_for_cpu` puts them (docs/results/vllm_cpu.md).
 * Every sum is loaded from y and stored back once per block, so its
 * chain stays k = 0, 1, …, K - 1. */

/* One product, y[M, N] = x[M, K] @ w[K, N], and the share of its columns one call computes:
 * c0 <= n < c1 into y (rows ldy floats apart, y[0] the row's column c0), part `part` of
 * `parts` (its share of the tiles' prefetch) */
typedef struct {
    const float *x;
    const uint32_t *xp;  /* x as bfloat16 pairs, for HS_BF16_COMPUTE panels (hs_round_pairs) */
    const void *w;       /* untagged; type: its HS_WEIGHT_TYPE bits; panels: HS_PANELS was set */
    float *y;
    int64_t ldx, M, K, N;
    int type, panels;
} product_job;
typedef struct {
    float *y;
    int64_t ldy, c0, c1;
    int part, parts;
} column_share;

/* -- weight storage ---------------------------------------------------------------------------
 * A weight is float32, or bfloat16 or float16 where every value of it is one (weights
 * stored in bf16 or fp16, loaded as float32: `HybridModel.pack_for_cpu`). Either converts to
 * float32 exactly (a bfloat16 value is the top half of its float32: a shift; float16 by the
 * F16C conversion), so the loops widen each weight as they load it and run the same float32
 * chains: the same bits as the float32 copy, from half the bytes, which is what a decode step
 * streaming its weights from memory is bound by. The pointer names the type (HS_WEIGHT_TYPE,
 * cpu/kernels.h: bit 0 bfloat16, bit 1 float16); every loop is compiled once per type from
 * cpu/rows_weights.h. */
/* (the loads that widen and both types' scalars: cpu/simd.h) */
#define WS_PASTE(name, type) name##_##type
#define WS_NAME(name, type) WS_PASTE(name, type)
#define WS(name) WS_NAME(name, W_TYPE_NAME)
#define FN_PASTE(name, g, q) name##_##g##_##q
#define FN_NAME(name, g, q) FN_PASTE(name, g, q)
#define FN(name, g, q) FN_NAME(WS(name), g, q) /* a step's or tile's name: FN(step, 2, 4) */

#define WT float
#define W_TYPE_NAME f32
#define WLOAD8 v8_load
#define WLOAD16 v16_load
#define WSCALAR(v) (v)
#define W_PER_LINE 16
#include "rows_weights.h"
#undef WT
#undef W_TYPE_NAME
#undef WLOAD8
#undef WLOAD16
#undef WSCALAR
#undef W_PER_LINE

#define WT uint16_t
#define W_TYPE_NAME bf16
/* From WIDEN_MIN_GROUPS row groups the tiles widen each panel's block into float32 once and run
 * the float32 tiles on it, instead of every group widening every weight vector (which takes the
 * multiply-add ports): at 30 and 40 rows widening once is clearly faster than widening every
 * vector, at 10 and 20 rows the two are even */
#define W_WIDENED_TILES tile_set_f32
#define W_WIDENED_TILES_512 AVX512_TILES_f32
#define W_WIDENED_TILES_2 AVX2_TILES_f32
#define WIDEN_MIN_GROUPS 3
#define WLOAD8 bf16x8
#define WLOAD16 bf16x16
#define WSCALAR(v) bf16_value(v)
#define W_PER_LINE 32
#include "rows_weights.h"
#undef W_TYPE_NAME
#undef WLOAD8
#undef WLOAD16
#undef WSCALAR

#define W_TYPE_NAME f16  /* the same 16-bit weights and widened tiles, the F16C conversion */
#define WLOAD8 f16x8
#define WLOAD16 f16x16
#define WSCALAR(v) f16_value(v)
#include "rows_weights.h"

/* -- threads ------------------------------------------------------------------------------
 * With more than one thread (`hs_set_threads`), a product of at least
 * PARALLEL_MIN_MACS multiply-adds is split into column ranges of whole
 * 64-column panels, one per thread, run by `hs_parallel` (cpu/pool.c);
 * `hs_rows_matmul_many` hands several products of one input (a block's q, k
 * and v, or gate and up) to the threads as one job, each thread taking its
 * share of every one. A column is computed by one thread with the same chain
 * as ever, so the bits do not depend on the thread count (tested). */
#define PARALLEL_MIN_MACS (1 << 16) /* below this the hand-off costs about what the split saves */
/* from this many multiply-adds (a prefill's product: 128 rows of a 1024 × 2048 weight) a job is not
 * taken back from a helper that claims late (`hs_parallel_long`): a late half still shortens it */
#define LONG_JOB_MACS (1 << 28)


/* the share s of j's product, by the weight's type */
static void product_columns(const product_job *j, const column_share *s) {
    if (j->panels)
        hs_panel_columns(j->x, j->ldx, j->xp, j->w, j->type, j->M, j->K, s->y, s->ldy, s->c0, s->c1);
    else if (j->type == HS_BF16_COMPUTE)
        hs_bf16_columns(j->x, j->ldx, j->w, j->M, j->K, j->N, s->y, s->ldy, s->c0, s->c1);
    else if (j->type == HS_BF16_WEIGHT)
        product_columns_bf16(j, s);
    else if (j->type == HS_F16_WEIGHT)
        product_columns_f16(j, s);
    else product_columns_f32(j, s);
}

/* Part `part` of the product. Its columns of y share cache lines (and the
 * pairs of lines the hardware prefetches together) with the next part's
 * wherever a row does not start on a 128-byte boundary, and the row groups
 * load and store y every few weight rows: written in place, two cores'
 * stores to those lines take away what the split gains (a product takes one
 * core's time). So parts past the first are computed into the
 * thread's own memory, rows 128 bytes apart, and copied into y at the end. */
static _Thread_local float *own;
static _Thread_local size_t own_floats;

/* part `part` of `parts` of one product: its share of the 64-column panels (the last part to N) */
static void product_share(const product_job *j, int part, int parts) {
    const int64_t panels = j->N / 64;
    const int64_t c0 = panels * part / parts * 64, c1 = part + 1 == parts ? j->N : panels * (part + 1) / parts * 64;
    if (c0 >= c1) return;
    const int64_t ld = (c1 - c0 + 31) / 32 * 32;
    if (part > 0 && own_floats < (size_t)(j->M * ld)) {
        free(own);
        own_floats = 0;
        if (posix_memalign((void **)&own, 128, (size_t)(j->M * ld) * sizeof(float))) own = 0;
        else own_floats = (size_t)(j->M * ld);
    }
    if (part == 0 || !own) { /* the first part, or no memory: in place */
        product_columns(j, &(column_share){j->y + c0, j->N, c0, c1, part, parts});
        return;
    }
    product_columns(j, &(column_share){own, ld, c0, c1, part, parts});
    for (int64_t m = 0; m < j->M; ++m) memcpy(j->y + m * j->N + c0, own + m * ld, (size_t)(c1 - c0) * sizeof(float));
}

/* Several products of one input in one job (a block's q, k and v; gate and up): each part takes
 * its share of every product, so the helpers are handed the stage once, not once per product */
#define MAX_PRODUCTS 4
typedef struct {
    int count;
    product_job jobs[MAX_PRODUCTS];
} products_job;

static void products_part(void *ctx, int part, int parts) {
    const products_job *j = ctx;
    for (int i = 0; i < j->count; ++i) product_share(j->jobs + i, part, parts);
}

/* the parts a job of `widest` columns and `macs` multiply-adds splits into (1: the caller alone) */
static int parts_for(int64_t widest, int64_t macs) {
    const int threads = hs_threads();
    const int parts = threads < widest / 64 ? threads : (int)(widest / 64);
    return macs >= PARALLEL_MIN_MACS ? parts : 1;
}

/* the products of `hs_rows_matmul_many` when one weight or more is quantized (HS_QUANT): one at a
 * time, a quantized one by `hs_quant_matmul` (its header: cpu/kernels.h) */
static int products_one_by_one(const float *x, int64_t ldx, int64_t M, int64_t K, int count,
                               const float *const *w, const int64_t *N, float *const *y) {
    for (int i = 0; i < count; ++i) {
        const uintptr_t address = (uintptr_t)w[i];
        const int64_t *header = (const int64_t *)(address & ~(uintptr_t)(HS_QUANT | HS_WEIGHT_TAGS));
        const int status = address & HS_QUANT
            ? hs_quant_matmul(x, ldx, (const uint8_t *)(uintptr_t)header[1], (int)header[0], M, K, N[i], y[i])
            : hs_rows_matmul_many(x, ldx, M, K, 1, w + i, N + i, y + i);
        if (status) return status;
    }
    return 0;
}

/* y_i[M, N_i] = x[M, K] @ w_i[K, N_i] for i < count (at most MAX_PRODUCTS), in one job over the
 * threads: each y_i has the bits `hs_rows_matmul` gives it. Returns 0, or -1 for sizes or
 * weights it does not take (checked before anything is computed). */
int hs_rows_matmul_many(const float *x, int64_t ldx, int64_t M, int64_t K, int count, const float *const *w,
                        const int64_t *N, float *const *y) {
    if (count < 1 || count > MAX_PRODUCTS || M < 0 || K < 0 || (M > 1 && ldx < K)) return -1;
    for (int i = 0; i < count; ++i)
        if ((uintptr_t)w[i] & HS_QUANT) return products_one_by_one(x, ldx, M, K, count, w, N, y);
    if (isa512 < 0) hs_rows_isa(-1);
    products_job job = {count, {{0}}};
    int64_t widest = 0, macs = 0;
    int rounds = 0;  /* a product of panels in bfloat16 compute: x rounded once for all */
    for (int i = 0; i < count; ++i) {
        const int type = (int)((uintptr_t)w[i] & HS_WEIGHT_TYPE), panels = ((uintptr_t)w[i] & HS_PANELS) != 0;
        if (N[i] < 0 || (type == HS_BF16_COMPUTE && !hs_bf16_supported())) return -1;
        job.jobs[i] = (product_job){x, 0, (const void *)((uintptr_t)w[i] & ~(uintptr_t)HS_WEIGHT_TAGS), y[i], ldx, M,
                                    K, N[i], type, panels};
        rounds |= panels && type == HS_BF16_COMPUTE;
        widest = N[i] > widest ? N[i] : widest;
        macs += M * K * N[i];
    }
    if (M == 0) return 0;
    uint32_t *xp = 0;
    if (rounds) {
        if (!(xp = malloc((size_t)(M * ((K + 1) / 2)) * sizeof *xp + 1))) return -1;
        hs_round_pairs(x, ldx, M, K, xp);
        for (int i = 0; i < count; ++i) job.jobs[i].xp = xp;
    }
    const int parts = parts_for(widest, macs);
    if (!(parts > 1 && (macs >= LONG_JOB_MACS ? hs_parallel_long : hs_parallel)(products_part, (void *)&job, parts)))
        products_part((void *)&job, 0, 1);
    free(xp);
    return 0;
}

/* y[M, N] = x[M, K] @ w[K, N]; returns 0, or -1 for sizes it does not take.
 * w: float32, or bfloat16 / float16 with HS_BF16_WEIGHT / HS_F16_WEIGHT set in its address (see
 * "weight storage" above). Rows split into balanced groups of at most
 * GROUP_ROWS (or tiles); columns over the threads (see above). */
int hs_rows_matmul(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y) {
    if (M < 0 || K < 0 || N < 0 || (M > 1 && ldx < K)) return -1;
    if (M == 0 || N == 0) return 0;
    return hs_rows_matmul_many(x, ldx, M, K, 1, &w, &N, &y);
}
