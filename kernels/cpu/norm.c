/* RMSNorm on x86 CPUs (AVX2 + FMA), optionally gated: for each row r and
 * each group of `group` consecutive channels,
 *     h = x[r]                    (gate NULL)  or  x[r] ⊙ silu(gate[r])
 *     out[r] = w ⊙ h · (mean over the group of h² + eps)^(-1/2)   (w NULL: 1)
 * x and gate are [rows, n] with unit channel stride (row strides passed); w
 * is [n]; out is [rows, n] contiguous. One pass over the row for the
 * statistics and one to write: the torch form is seven operations. Built by
 * `cpu/native.py`, used through `cpu/norm.py`.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#include "simd.h"

int hs_rms_norm(const float *x, int64_t ldx, const float *gate, int64_t ldg, const float *w, float *out,
                int64_t rows, int64_t n, int64_t group, float eps) {
    if (rows < 0 || n < 1 || group < 1 || n % group) return -1;
    const v8 one = v8_set1(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * ldx, *gr = gate ? gate + r * ldg : 0;
        float *o = out + r * n;
        if (gr) {  /* h = x ⊙ silu(g) = x ⊙ g / (1 + e^-g), into out first */
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                v8 g = v8_load(gr + j);
                v8 s = v8_div(g, v8_add(one, exp8(v8_sub(v8_zero(), g))));
                v8_store(o + j, v8_mul(v8_load(xr + j), s));
            }
            for (; j < n; ++j) o[j] = xr[j] * (gr[j] / (1.0f + expf(-gr[j])));
            xr = o;
        }
        for (int64_t g0 = 0; g0 < n; g0 += group) {
            const float *h = xr + g0;
            v8 acc = v8_zero();
            int64_t j = 0;
            for (; j + 8 <= group; j += 8) {
                v8 v = v8_load(h + j);
                acc = v8_fmadd(v, v, acc);
            }
            float ss = hsum8(acc);
            for (; j < group; ++j) ss = fmaf(h[j], h[j], ss);
            const float scale = 1.0f / sqrtf(ss / (float)group + eps);
            const v8 scale8 = v8_set1(scale);
            float *og = o + g0;
            const float *wg = w ? w + g0 : 0;
            for (j = 0; j + 8 <= group; j += 8) {
                v8 v = v8_mul(v8_load(h + j), scale8);
                v8_store(og + j, wg ? v8_mul(v8_load(wg + j), v) : v);
            }
            for (; j < group; ++j) og[j] = wg ? wg[j] * (h[j] * scale) : h[j] * scale;
        }
    }
    return 0;
}
