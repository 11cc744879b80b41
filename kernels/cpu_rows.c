/* Few-row matrix products on x86 CPUs with AVX2 and FMA: y = x @ w.
 *
 * x is [M, K] (rows `ldx` floats apart, unit column stride), w is [K, N]
 * contiguous (input-major: what `HybridModel.pack_for_cpu` stores), y is
 * [M, N] contiguous. Built by `cpu_native.py`, used through `cpu_rows.py` (see there for why).
 *
 * The weight is streamed once per block of up to ROW_BLOCK rows, in memory
 * order, four rows of w at a time; each row of x keeps its chunk of y in L1
 * and adds four products per load and store. A decode step reads every weight
 * once from memory, so one row costs what the memory takes and a few more
 * rows (a verify forward of γ + 1 tokens) add arithmetic that hides behind it.
 *
 * Every output is the same chain of fused multiply-adds over k = 0, 1, …,
 * K - 1 starting from zero, whatever M, the row's position in the call or the
 * column's position in a vector: a row's result does not depend on what else
 * is multiplied with it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include <string.h>

#define ROW_BLOCK 8
#define CHUNK_FLOATS 4096 /* y floats per chunk: 16 KiB, half an L1 data cache */

static inline void tail_columns(int rows, const float *x, int64_t ldx, const float *w, int64_t N,
                                int64_t k, int kb, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    for (int m = 0; m < rows; ++m)
        for (int64_t n = n0; n < n1; ++n) {
            float s = y[m * ldy + n];
            for (int j = 0; j < kb; ++j) s = fmaf(x[m * ldx + k + j], w[(k + j) * N + n], s);
            y[m * ldy + n] = s;
        }
}

/* y[:, n0:n1] += x[:, 0:K] @ w[:, n0:n1] for ROWS rows, n1 - n0 a multiple of 8 */
#define DEFINE_BLOCK(ROWS)                                                                            \
    static void block_##ROWS(const float *x, int64_t ldx, const float *w, int64_t K, int64_t N,       \
                             int64_t n0, int64_t n1, float *y, int64_t ldy) {                         \
        int64_t k = 0;                                                                                \
        for (; k + 4 <= K; k += 4) {                                                                  \
            const float *w0 = w + k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;                    \
            __m256 b[ROWS][4];                                                                        \
            for (int m = 0; m < ROWS; ++m)                                                            \
                for (int j = 0; j < 4; ++j) b[m][j] = _mm256_broadcast_ss(x + m * ldx + k + j);       \
            for (int64_t n = n0; n < n1; n += 8) {                                                    \
                __m256 a0 = _mm256_loadu_ps(w0 + n), a1 = _mm256_loadu_ps(w1 + n);                    \
                __m256 a2 = _mm256_loadu_ps(w2 + n), a3 = _mm256_loadu_ps(w3 + n);                    \
                for (int m = 0; m < ROWS; ++m) {                                                      \
                    float *out = y + m * ldy + n;                                                     \
                    __m256 acc = _mm256_loadu_ps(out);                                                \
                    acc = _mm256_fmadd_ps(b[m][0], a0, acc);                                          \
                    acc = _mm256_fmadd_ps(b[m][1], a1, acc);                                          \
                    acc = _mm256_fmadd_ps(b[m][2], a2, acc);                                          \
                    acc = _mm256_fmadd_ps(b[m][3], a3, acc);                                          \
                    _mm256_storeu_ps(out, acc);                                                       \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (; k < K; ++k) {                                                                          \
            const float *wk = w + k * N;                                                              \
            for (int m = 0; m < ROWS; ++m) {                                                          \
                __m256 b0 = _mm256_broadcast_ss(x + m * ldx + k);                                     \
                for (int64_t n = n0; n < n1; n += 8) {                                                \
                    float *out = y + m * ldy + n;                                                     \
                    _mm256_storeu_ps(out, _mm256_fmadd_ps(b0, _mm256_loadu_ps(wk + n), _mm256_loadu_ps(out))); \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
DEFINE_BLOCK(5)
DEFINE_BLOCK(6)
DEFINE_BLOCK(7)
DEFINE_BLOCK(8)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, int64_t, float *,
                         int64_t);
static const block_fn BLOCKS[ROW_BLOCK + 1] = {0,       block_1, block_2, block_3, block_4,
                                               block_5, block_6, block_7, block_8};

/* y[M, N] = x[M, K] @ w[K, N]; returns 0, or -1 for sizes it does not take.
 * Column chunks sized for ROW_BLOCK rows of y to stay in L1; each block of
 * rows streams the weight once (the Python side sends at most ROW_BLOCK rows:
 * beyond that MKL's blocked products are faster). */
int hs_rows_matmul(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y) {
    if (M < 0 || K < 0 || N < 0 || (M > 1 && ldx < K)) return -1;
    if (M == 0 || N == 0) return 0;
    memset(y, 0, (size_t)M * (size_t)N * sizeof(float));
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int rows = (int)(M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK);
        const float *xm = x + m0 * ldx;
        float *ym = y + m0 * N;
        int64_t chunk = (CHUNK_FLOATS / rows) / 8 * 8;
        for (int64_t n0 = 0; n0 < N; n0 += chunk) {
            int64_t n1 = n0 + chunk < N ? n0 + chunk : N;
            int64_t vec_end = n0 + (n1 - n0) / 8 * 8;
            if (vec_end > n0) BLOCKS[rows](xm, ldx, w, K, N, n0, vec_end, ym, N);
            if (vec_end < n1) {
                int64_t k = 0;
                for (; k + 4 <= K; k += 4) tail_columns(rows, xm, ldx, w, N, k, 4, vec_end, n1, ym, N);
                for (; k < K; ++k) tail_columns(rows, xm, ldx, w, N, k, 1, vec_end, n1, ym, N);
            }
        }
    }
    return 0;
}
