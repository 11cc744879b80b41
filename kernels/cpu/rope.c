/* Rotary position embedding (rotate-half form) on x86 CPUs (AVX2): for each
 * row r (one input position) and head h of x [rows, heads, head_dim],
 *     out[i]        = x[i] · cos[i] − x[i + half] · sin[i]          (i < half)
 *     out[i + half] = x[i + half] · cos[i] + x[i] · sin[i]          (i < half)
 *     out[i]        = x[i]                                          (i >= 2 · half)
 * with cos, sin [rows, half] (row stride ldc) the angles of the row's position. Each value is
 * rounded as torch rounds `x·cos + rotate_half(x)·sin` (two products, then
 * their sum; the build turns contraction into FMA off), so the C path and the
 * torch path of `models.attention.Rotation` give the same bits. x and out are
 * contiguous; out may be x (every value is read before it is written). Built
 * by `cpu/native.py`, used through `cpu/rope.py` and `cpu/blocks.c`.
 */
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

int hs_rope(const float *x, const float *cos, const float *sin, int64_t ldc, float *out, int64_t rows,
            int64_t heads, int64_t head_dim, int64_t half) {
    if (rows < 0 || heads < 1 || half < 1 || 2 * half > head_dim || ldc < half) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * ldc, *s = sin + r * ldc;
        for (int64_t h = 0; h < heads; ++h) {
            const float *x1 = x + (r * heads + h) * head_dim, *x2 = x1 + half;
            float *o1 = out + (r * heads + h) * head_dim, *o2 = o1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                v8 a = v8_load(x1 + i), b = v8_load(x2 + i);
                v8 ci = v8_load(c + i), si = v8_load(s + i);
                v8 ac = v8_mul(a, ci), bs = v8_mul(b, si);
                v8 bc = v8_mul(b, ci), as = v8_mul(a, si);
                v8_store(o1 + i, v8_sub(ac, bs));
                v8_store(o2 + i, v8_add(bc, as));
            }
            for (; i < half; ++i) {
                float ac = x1[i] * c[i], bs = x2[i] * s[i], bc = x2[i] * c[i], as = x1[i] * s[i];
                o1[i] = ac - bs;
                o2[i] = bc + as;
            }
            for (int64_t j = 2 * half; j < head_dim; ++j) o1[j] = x1[j] + 0.0f;  /* x·1 + 0·0, as torch adds */
        }
    }
    return 0;
}
