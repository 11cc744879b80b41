/* Declarations of the native kernels that `cpu_blocks.c` chains; each source
 * that defines one includes this file, so the compiler checks that the two agree. */
#ifndef HYBRIDSPEC_CPU_KERNELS_H
#define HYBRIDSPEC_CPU_KERNELS_H

#include <stdint.h>

int hs_rows_matmul(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y);
int hs_rms_norm(const float *x, int64_t ldx, const float *gate, int64_t ldg, const float *w, float *out,
                int64_t rows, int64_t n, int64_t group, float eps);
int hs_conv_window_steps(float *states, const int64_t *src, const int64_t *dst,
                         const float *xs, int64_t sxb, int64_t sxt, const float *weight, const float *bias,
                         int64_t silu, float *out, int64_t batch, int64_t T, int64_t conv_dim, int64_t d_conv);
int hs_mamba2_steps(float *states, const int64_t *src, const int64_t *dst, float *scratch,
                    const float *x, int64_t sxb, int64_t sxt, int64_t sxh,
                    const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *D,
                    const float *B, int64_t sBb, int64_t sBt, int64_t sBg,
                    const float *C, int64_t sCb, int64_t sCt, int64_t sCg,
                    float *y, int64_t batch, int64_t T, int64_t nheads, int64_t headdim, int64_t d_state,
                    int64_t ngroups);
int hs_rope(const float *x, const float *cos, const float *sin, int64_t ldc, float *out, int64_t rows,
            int64_t heads, int64_t head_dim, int64_t half);

#endif
