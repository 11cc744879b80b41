/* Few-row matrix products on x86 CPUs with AVX2 and FMA: y = x @ w.
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
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include <string.h>

#define GROUP_ROWS 5     /* rows of x per register group */
#define KBLOCK 12        /* weight rows the groups take in turn (a multiple of every Q) */
#define PREFETCH_ROWS 8  /* how far ahead, in weight rows, the stream is prefetched */

/* y[0:G, 0:n1] += x[0:G, k:k+Q] @ w[k:k+Q, 0:n1], n1 a multiple of 8 */
#define DEFINE_STEP(G, Q)                                                                               \
    static void step_##G##_##Q(const float *x, int64_t ldx, const float *w, int64_t N, int64_t k,      \
                               int64_t n1, float *y, int64_t ldy) {                                    \
        __m256 b[G][Q];                                                                                 \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g)                                             \
            _Pragma("GCC unroll 8") for (int q = 0; q < Q; ++q)                                         \
                b[g][q] = _mm256_broadcast_ss(x + g * ldx + k + q);                                     \
        const float *wk = w + k * N;                                                                    \
        for (int64_t n = 0; n < n1; n += 8) {                                                           \
            if ((n & 15) == 0) /* one prefetch per cache line of each row */                            \
                _Pragma("GCC unroll 8") for (int q = 0; q < Q; ++q)                                     \
                    _mm_prefetch((const char *)(wk + (PREFETCH_ROWS + q) * N + n), _MM_HINT_T0);        \
            __m256 a[Q];                                                                                \
            _Pragma("GCC unroll 8") for (int q = 0; q < Q; ++q) a[q] = _mm256_loadu_ps(wk + q * N + n); \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {                                       \
                float *out = y + g * ldy + n;                                                           \
                __m256 acc = _mm256_loadu_ps(out);                                                      \
                _Pragma("GCC unroll 8") for (int q = 0; q < Q; ++q) acc = _mm256_fmadd_ps(b[g][q], a[q], acc); \
                _mm256_storeu_ps(out, acc);                                                             \
            }                                                                                           \
        }                                                                                               \
    }

DEFINE_STEP(1, 4)
DEFINE_STEP(1, 1)
DEFINE_STEP(2, 4)
DEFINE_STEP(2, 1)
DEFINE_STEP(3, 3)
DEFINE_STEP(3, 1)
DEFINE_STEP(4, 2)
DEFINE_STEP(4, 1)
DEFINE_STEP(5, 2)
DEFINE_STEP(5, 1)

typedef void (*step_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, float *, int64_t);
static const step_fn STEP_Q[GROUP_ROWS + 1] = {0, step_1_4, step_2_4, step_3_3, step_4_2, step_5_2};
static const step_fn STEP_1[GROUP_ROWS + 1] = {0, step_1_1, step_2_1, step_3_1, step_4_1, step_5_1};
static const int Q_OF[GROUP_ROWS + 1] = {0, 4, 4, 3, 2, 2}; /* weight rows per step for G rows */

/* the columns past the last multiple of 8, k0 <= k < k1: the same chain, one float at a time */
static void tail_columns(int G, const float *x, int64_t ldx, const float *w, int64_t N, int64_t k0, int64_t k1,
                         int64_t n0, float *y, int64_t ldy) {
    for (int g = 0; g < G; ++g)
        for (int64_t n = n0; n < N; ++n) {
            float s = y[g * ldy + n];
            for (int64_t k = k0; k < k1; ++k) s = fmaf(x[g * ldx + k], w[k * N + n], s);
            y[g * ldy + n] = s;
        }
}

/* y[M, N] = x[M, K] @ w[K, N]; returns 0, or -1 for sizes it does not take.
 * Rows split into balanced groups of at most GROUP_ROWS. */
int hs_rows_matmul(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y) {
    if (M < 0 || K < 0 || N < 0 || (M > 1 && ldx < K)) return -1;
    if (M == 0 || N == 0) return 0;
    memset(y, 0, (size_t)M * (size_t)N * sizeof(float));
    int64_t groups = (M + GROUP_ROWS - 1) / GROUP_ROWS, vec_end = N / 8 * 8;
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int64_t group = 0; group < groups; ++group) {
            int64_t m0 = M * group / groups, m1 = M * (group + 1) / groups;
            int G = (int)(m1 - m0), Q = Q_OF[G];
            const float *xg = x + m0 * ldx;
            float *yg = y + m0 * N;
            int64_t k = k0;
            if (vec_end > 0) {
                for (; k + Q <= k1; k += Q) STEP_Q[G](xg, ldx, w, N, k, vec_end, yg, N);
                for (; k < k1; ++k) STEP_1[G](xg, ldx, w, N, k, vec_end, yg, N);
            }
            if (vec_end < N) tail_columns(G, xg, ldx, w, N, k0, k1, vec_end, yg, N);
        }
    }
    return 0;
}
