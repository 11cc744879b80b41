"""RMSNorm, plain and gated, on CPU in C (`cpu/norm.c`) for float32 runs.

Why: the torch form (`ops.Norm`, plain and gated) is seven to nine operations per call, and a small model calls
it two or three times per layer per forward; one C call reads the row once
for the statistics and once to write. Used under the conditions of the other
native kernels (`cpu_native.takes`), for rows with a unit channel stride.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native


def as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """`t` [..., n] as a [rows, n] view with unit channel stride (None when it is not one)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])  # merges the leading dimensions when they step evenly
    except RuntimeError:
        return None


def applies(x: torch.Tensor, weight: torch.Tensor | None, gate: torch.Tensor | None = None) -> bool:
    return (x.numel() > 0 and x.stride(-1) == 1
            and (weight is None or (weight.is_contiguous() and weight.numel() == x.shape[-1]))
            and cpu_native.takes(x, *(t for t in (weight, gate) if t is not None)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
             group: int | None = None) -> torch.Tensor | None:
    """w ⊙ h · rsqrt(mean(h²) + eps) over groups of `group` channels (default all),
    h = x or x ⊙ silu(gate); a new contiguous tensor shaped like x. None when x or
    gate cannot be read as rows (the caller then runs the torch form)."""
    rows = as_rows(x)
    gate_rows = None if gate is None else as_rows(gate)
    if rows is None or (gate is not None and (gate_rows is None or gate_rows.shape != rows.shape)):
        return None
    n = rows.shape[1]
    out = torch.empty(x.shape, dtype=torch.float32)
    status = cpu_native.call(
        "rms_norm",
                rows.data_ptr(), rows.stride(0), None if gate_rows is None else gate_rows.data_ptr(),
        0 if gate_rows is None else gate_rows.stride(0), None if weight is None else weight.data_ptr(),
        out.data_ptr(), rows.shape[0], n, group or n, eps)
    if status != 0:
        raise ValueError(f"rms_norm: shapes not taken: x {tuple(x.shape)}, group {group}")
    return out
