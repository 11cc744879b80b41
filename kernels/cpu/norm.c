/* RMSNorm on x86 CPUs (AVX2 + FMA), optionally gated: for each row r and
 * each group of `group` consecutive channels,
 *     h = x[r]                    (gate NULL)  or  x[r] ⊙ silu(gate[r])
 *     out[r] = w ⊙ h · (mean over the group of h² + eps)^(-1/2)   (w NULL: 1)
 * x and gate are [rows, n] with unit channel stride (row strides passed); w
 * is [n]; out is [rows, n] contiguous. One pass over the row for the
 * statistics and one to write: the torch form is seven operations. Many rows
 * (a prefill's) split over the threads. Built by `cpu/native.py`, used through
 * `cpu/norm.py`.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#include "simd.h"

typedef struct {
    const float *x, *gate, *w;
    float *out;
    int64_t ldx, ldg, rows, n, group;
    float eps;
} norm_job;

/* rows r0 <= r < r1 */
static void norm_rows(const norm_job *job, int64_t r0, int64_t r1) {
    const float *x = job->x, *gate = job->gate, *w = job->w;
    float *out = job->out;
    const int64_t ldx = job->ldx, ldg = job->ldg, n = job->n, group = job->group;
    const float eps = job->eps;
    const v8 one = v8_set1(1.0f);
    for (int64_t r = r0; r < r1; ++r) {
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
}

/* Many rows (a prefill's) split over the threads (`hs_parallel_units`); each row is the same loop on
 * any thread, so the bits do not change */
#define PARALLEL_MIN_FLOATS (1 << 18) /* x's floats below which one thread normalizes */

static void norm_part(void *ctx, int part, int parts) {
    const norm_job *job = ctx;
    norm_rows(job, job->rows * part / parts, job->rows * (part + 1) / parts);
}

int hs_rms_norm(const float *x, int64_t ldx, const float *gate, int64_t ldg, const float *w, float *out,
                int64_t rows, int64_t n, int64_t group, float eps) {
    if (rows < 0 || n < 1 || group < 1 || n % group) return -1;
    norm_job job = {x, gate, w, out, ldx, ldg, rows, n, group, eps};
    if (!hs_parallel_units(norm_part, &job, rows, rows * n, PARALLEL_MIN_FLOATS)) norm_rows(&job, 0, rows);
    return 0;
}
