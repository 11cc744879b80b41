"""Quantized matrix products on CPU (`cpu/quant.c`): x [M, K] @ a `QuantWeight`'s transpose, for
any row count (decode, verify, drafting and prefill), in C with the other native kernels.

Activations are rounded per row to int8 blocks with a float32 scale (blocks of 32 for Q8_0 and
Q4_0 weights, 256 for Q4_K and Q6_K: `formats.quantize_rows_q8`), as llama.cpp rounds them, and each block
pair meets in an exact integer dot product; each output's float chain is fixed (cpu/quant.c,
cpu/quant_q6k.h), so a
row's bits do not depend on the other rows, the thread count, the few-row or many-row path, or
the ISA (AVX2 or AVX512-VNNI, `vector_path`). Against a float64 product of the same rounded
activations and dequantized weights, an output is off by at most `error_bound` (float32 lanes
summed over the blocks). `weight.matmul` is the torch form of the same values.

Used by the native backend's `linear` (`ops.NativeLinear`) for a `QuantWeight` when the operands
are float32 CPU tensors, x rows contiguous, no autograd and the kernels built.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.quant.weight import QuantWeight

VECTOR_PATHS = ("avx2", "avx512vnni")


def vector_path(choice: str | None = None) -> str:
    """The integer dot product in use: "avx512vnni" where the CPU has it (chosen on first use),
    else "avx2"; `choice` sets it for the process (the same bits either way). ValueError for a
    choice this CPU cannot take."""
    return cpu_native.choose_isa("hs_quant_isa", VECTOR_PATHS, choice, "AVX512-VNNI")


def applies(x: torch.Tensor, weight: QuantWeight) -> bool:
    """Whether `quant_matmul(x, weight)` runs: x [M, K] float32 on the CPU (at least one row, rows
    contiguous along K), no autograd, the kernels built."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.shape[1] == weight.in_features and x.stride(1) == 1
            and (x.shape[0] == 1 or x.stride(0) >= x.shape[1])
            and not (torch.is_grad_enabled() and x.requires_grad) and cpu_native.takes(x))


def quant_matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ -> [M, N] float32 with the C kernel; the caller checked `applies`."""
    M, K = x.shape
    out = torch.empty(M, weight.out_features, dtype=torch.float32)
    row_stride = x.stride(0) if M > 1 else K
    if cpu_native.library().hs_quant_matmul(x.data_ptr(), row_stride, weight.data_ptr(), weight.code, M, K,
                                            weight.out_features, out.data_ptr()) != 0:
        raise ValueError(f"quant_matmul: not taken: x {tuple(x.shape)} stride {x.stride()}, {weight!r}")
    return out


def laid_out(weight: QuantWeight) -> QuantWeight:
    """`weight` as these products read it fastest: interleaved in place (`QuantWeight.interleave_`) where
    it can be: Q4_K on either path (AVX512-VNNI's 16-column tiles then load what they would transpose,
    AVX2's 8-column ones read half of each word vector; cpu/quant.c, HS_X16), Q6_K on AVX512-VNNI (its
    16-column tiles at every row count, a greedy draft's coarse LM head over its high plane alone;
    cpu/quant_q6k.h; AVX2 reads such weights a word at a time, so on AVX2 they stay as they are); else
    as it is. The same values and products either way."""
    q6_on_avx2 = weight.fmt.name == "q6_k" and vector_path() != "avx512vnni"
    if weight.interleaved or not weight.can_interleave() or q6_on_avx2:
        return weight
    return weight.interleave_()


def error_bound(x_rounded: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A bound [M, N] on |kernel − float64 product| for rounded activations x_rounded [M, K] and
    dequantized weights values [N, K]: the scale products dw · dx and the lane sums rounded to
    float32 at most about K / 32 + 16 times per output, each within 2⁻²⁴ of Σ|terms|."""
    K = x_rounded.shape[1]
    magnitude = x_rounded.abs().double() @ values.abs().double().t()
    return magnitude * (K / 32 + 16) * 2.0 ** -23
