"""Few-row float32 matrix products on CPU (decode, drafting, verification, short prefills).

Why: a decode step of a small model reads every weight once from memory, and
MKL's kernels neither stream a cold weight at the memory's speed nor keep
the cost of 2–16 rows near the cost of one (with the weights out of cache,
five rows cost MKL several times one row), so a verify forward of γ + 1
tokens would cost about two plain steps. `cpu/rows.c` streams the weight in memory order,
prefetched ahead, for groups of up to 5 rows, and hides the extra rows'
arithmetic behind the memory; on CPUs with AVX-512 it takes 16 columns per
vector (same bits, fewer instructions, which bound the product once the
weights are in cache; `vector_path`). From 10–16
rows register tiles take over (a verify of batch 2–4 and up), again with the
same bits. It is built and loaded with the other native CPU kernels (`cpu_native`).

Used by the native backend's `linear` op (`ops.NativeLinear`) when every condition holds: float32 CPU
tensors, a weight in panels (what `HybridModel.pack_for_cpu` stores for a float32 model; `hs.load`
packs on CPU; `cpu/panels.c`) or, for at most `MAX_ROWS` rows, an input-major contiguous one
(a MoE's experts), float32 or its
exact bfloat16 or float16 copy (pack_for_cpu's `exact_16bit`: the kernel
widens each weight as it loads it, the same bits from half the bytes), no
autograd, and
the native kernels on (`cpu_native.available`). With more than one torch
thread the kernel splits a product's columns over that many threads (helpers
it keeps, `cpu_native.sync_threads`). Each output is the fused multiply-add
chain over the input dimension in order, computed by one thread, so a row's
result does not depend on the other rows of the call nor on the thread count
(batch invariance at the bit level: at any row count for a weight in panels, up to
`MAX_ROWS` rows for an input-major one). float64 (the parity
suites) always takes `torch.mm`.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu.panels import PanelWeight

# rows up to which `linear` takes the kernel for an input-major weight (a MoE's experts; weights in
# panels take it at any count); also the inputs per sequence the blocks take (`cpu_blocks.BLOCK_ROWS`).
# With the weights out of cache the kernel is faster than MKL up to about 20 rows and about as fast
# beyond, sometimes slower (`benches/cpu_kernels.py`)
MAX_ROWS = 96


VECTOR_PATHS = ("avx2", "avx512")


def vector_path(choice: str | None = None) -> str:
    """The kernel's vectors: "avx512" where the CPU has AVX-512F (chosen on first
    use), else "avx2"; `choice` sets it for the process (the results are the same
    bits either way: each output is the same chain). Raises ValueError for a
    choice this CPU cannot take."""
    return cpu_native.choose_isa("hs_rows_isa", VECTOR_PATHS, choice, "AVX-512F")


def applies(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether `rows_matmul(x, weight_t)` runs for these operands (see the module docstring): up to
    MAX_ROWS rows; any count for a weight in panels (there the kernel is faster than MKL on the
    unpacked weight at a prefill's rows too, at any thread count beside torch's operations on one
    thread, `cpu_native.torch_on_one_thread`: docs/results/llamacpp.md, "Prefill over the kernels'
    threads")."""
    return (x.shape[0] <= MAX_ROWS or isinstance(weight_t, PanelWeight)) and _operands_ok(x, weight_t)


def applies_bf16(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether `rows_matmul(x, weight_t, torch.bfloat16)` runs: `applies`' conditions at any row
    count (the bfloat16 products have no faster path for many rows to give way to, and a row's
    bits then never depend on the call's rows), for a bfloat16 weight."""
    return weight_t.dtype is torch.bfloat16 and _operands_ok(x, weight_t)


def _operands_ok(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """What the C kernel reads: rows of x contiguous along K (at least one), a weight of a type and
    layout it reads (input-major and contiguous, or `PanelWeight`), no autograd, float32 x on a CPU
    where the kernels are built."""
    return (x.shape[0] > 0 and x.dim() == 2 and x.stride(1) == 1
            and (x.shape[0] == 1 or x.stride(0) >= x.shape[1]) and weight_t.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight_t.requires_grad))
            and cpu_native.weight_dtype_ok(weight_t) and cpu_native.takes(x))


def _sizes(weight_t: torch.Tensor) -> tuple[int, int]:
    """(K, N) of a product weight the kernel takes: input-major [K, N], or panels."""
    if isinstance(weight_t, PanelWeight):
        return weight_t.in_features, weight_t.out_features
    return tuple(weight_t.shape)


def rows_matmul(x: torch.Tensor, weight_t: torch.Tensor, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] (input-major, or a `PanelWeight` [N, K]) -> [M, N] with the C
    kernel; the caller checked `applies` (`applies_bf16` for `compute` bfloat16: x rounded to
    bfloat16, `cpu/rows_bf16.c`)."""
    M, K = x.shape
    weight_k, N = _sizes(weight_t)
    if weight_k != K:
        raise ValueError(f"rows_matmul: x is {tuple(x.shape)} but the weight is {tuple(weight_t.shape)}")
    out = torch.empty(M, N, dtype=torch.float32)
    row_stride = x.stride(0) if M > 1 else K  # a one-row view may carry any row stride
    if cpu_native.library().hs_rows_matmul(x.data_ptr(), row_stride, cpu_native.weight_address(weight_t, compute), M, K, N,
                                           out.data_ptr()) != 0:
        raise ValueError(f"rows_matmul: sizes not taken: x {tuple(x.shape)} stride {x.stride()}, weight "
                         f"{tuple(weight_t.shape)}")
    return out
