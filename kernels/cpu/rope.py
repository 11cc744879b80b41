"""The rotary embedding of queries and keys on CPU in C (`cpu/rope.c`) for float32 runs.

Why: the torch form (`models.attention.Rotation.apply`: a product with the
rotate-half matrix, two multiplications and a sum) is four operations per
tensor, twice per attention layer per forward; one C call reads x once. The
same bits as the torch form (but for the sign of a zero past the rotary
dims). Used under the conditions of the other native kernels
(`cpu_native.takes`), for contiguous x.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import native as cpu_native


def angle_rows(t: torch.Tensor) -> int | None:
    """The row stride of cos or sin [batch, T, half] read as [batch · T, half] rows (None: not so laid out)."""
    if t.stride(-1) != 1 or t.stride(0) != t.shape[1] * t.stride(1):
        return None
    return t.stride(1)


def applies(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> bool:
    """Whether `rope(x, cos_half, sin_half)` runs: x [batch, T, heads, head_dim]
    contiguous, cos/sin [batch, T, half] rows of one stride, float32 on CPU."""
    return (x.dim() == 4 and x.is_contiguous() and cos_half.dim() == 3
            and cos_half.shape == sin_half.shape == (*x.shape[:2], cos_half.shape[-1])
            and 0 < 2 * cos_half.shape[-1] <= x.shape[-1] and angle_rows(cos_half) is not None
            and angle_rows(cos_half) == angle_rows(sin_half) and cpu_native.takes(x, cos_half, sin_half))


def rope(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """x rotated by the angles of its positions (see `cpu/rope.c`); a new tensor
    shaped like x. The caller checked `applies`."""
    batch, T, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=torch.float32)
    if cpu_native.call("rope", x.data_ptr(), cos_half.data_ptr(), sin_half.data_ptr(), angle_rows(cos_half),
                       out.data_ptr(), batch * T, heads, head_dim, cos_half.shape[-1]) != 0:
        raise ValueError(f"rope: shapes not taken: x {tuple(x.shape)}, angles {tuple(cos_half.shape)}")
    return out
