/* Elementwise softplus and sigmoid on CPUs whose every output is the scalar libm
 * value of its input, wherever the element lies in its tensor. torch's loops
 * compute these two functions one way in a tensor's vectorized body and another
 * in its tail (they can differ in the last bit), so under torch a row's values
 * would depend on how many elements the rows beside it add: batch invariance at
 * the bit level needs them position-free. softplus is the one the Mamba-2 block
 * computes Δ with (`hs_softplus`, cpu/kernels.h), so the layer-by-layer path and
 * the block agree. Built by
 * `cpu/native.py`, used by the native backend's `ops.NativePointwise`.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* y[i] = softplus(x[i]) (fn HS_SOFTPLUS) or sigmoid(x[i]) (HS_SIGMOID) for i < n; x and y contiguous,
 * y may be x. Returns 0, or -1 for a function it does not know. */
int hs_pointwise(int fn, const float *x, float *y, int64_t n) {
    if (fn == HS_SOFTPLUS)
        for (int64_t i = 0; i < n; ++i) y[i] = hs_softplus(x[i]);
    else if (fn == HS_SIGMOID)
        for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + expf(-x[i]));
    else return -1;
    return 0;
}
