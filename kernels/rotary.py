"""The rotary embedding of one forward (Su et al. 2021): the angles of every
input's position, shared by the forward's attention layers, and their
application to queries and keys.

`Rotation.apply` is HF's rotate-half rotation with its products and sums: in
C for float32 on CPU where the backend has the native kernels
(`kernels.cpu_rope`, the same bits), else as x·cos + (x R)·sin with cos and
sin padded to the whole head (1 and 0 past rotary_dim), in four operations
per tensor."""
from __future__ import annotations

import functools

import torch

from hybridspec.kernels.cpu import rope as cpu_rope

_ROTATE_HALF: dict[tuple, torch.Tensor] = {}


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


@functools.cache
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rotate_half_matrix(head_dim: int, rotary_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """R [head_dim, head_dim] with x @ R = (-x2, x1, 0) over the rotary dims (x1, x2
    their halves) and 0 on the rest: an exact signed permutation. Cached."""
    key = (head_dim, rotary_dim, dtype, str(device))
    if key not in _ROTATE_HALF:
        half = rotary_dim // 2
        R = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
        i = torch.arange(half, device=device)
        R[i + half, i] = -1.0
        R[i, i + half] = 1.0
        _ROTATE_HALF[key] = R
    return _ROTATE_HALF[key]


_PADDED_INV_FREQ: dict[tuple, torch.Tensor] = {}


def padded_inv_freq(inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """inv_freq in `dtype`, zero-padded to a multiple of 16 values; cached per storage."""
    key = (inv_freq.data_ptr(), inv_freq.numel(), dtype, str(inv_freq.device))
    padded = _PADDED_INV_FREQ.get(key)
    if padded is None:
        padded = inv_freq.new_zeros(-(-inv_freq.numel() // 16) * 16, dtype=dtype)
        padded[:inv_freq.numel()] = _as_dtype(inv_freq, dtype)
        _PADDED_INV_FREQ[key] = padded
    return padded


class Rotation:
    """One forward's rotary angles: cos and sin of each input's position over
    the rotary half [batch, T, rotary_dim / 2] (views of rows padded to 16
    values; four operations per forward). Made by the backend's `rotary` op."""

    native = False  # the C rotation where it takes the tensors (`NativeRotation`)

    def __init__(self, rotary_dim: int, head_dim: int, inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype):
        cd = _compute_dtype(dtype)
        # each position's angles padded to a multiple of 16: torch's vectorised cos and sin then take
        # every value in full vectors, so a position's bits do not depend on how many inputs the forward has
        freqs = positions.to(cd)[..., None] * padded_inv_freq(inv_freq, cd)  # [batch, T, ≥ rotary_dim / 2]
        half = rotary_dim // 2
        self.cos_half = _as_dtype(freqs.cos(), dtype)[..., :half]  # [batch, T, rotary_dim / 2] views
        self.sin_half = _as_dtype(freqs.sin(), dtype)[..., :half]
        self.rotary_dim, self.head_dim, self.device = rotary_dim, head_dim, positions.device

    @functools.cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin [batch, T, 1, head_dim], R) for the torch form."""
        cos, sin = torch.cat((self.cos_half, self.cos_half), dim=-1), torch.cat((self.sin_half, self.sin_half), dim=-1)
        if self.rotary_dim < self.head_dim:  # the dims past rotary_dim pass through: cos 1, sin 0
            pad = cos.new_zeros(*cos.shape[:-1], self.head_dim - self.rotary_dim)
            cos, sin = torch.cat((cos, pad + 1), dim=-1), torch.cat((sin, pad), dim=-1)
        return cos[:, :, None], sin[:, :, None], rotate_half_matrix(self.head_dim, self.rotary_dim, cos.dtype,
                                                                    self.device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # [batch, T, heads, head_dim]
        cos, sin, R = self.padded
        rotated = torch.mm(x.reshape(-1, x.shape[-1]), R).view(x.shape)
        return x * cos + rotated * sin


class NativeRotation(Rotation):
    native = True

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_rope.applies(x, self.cos_half, self.sin_half):
            return cpu_rope.rope(x, self.cos_half, self.sin_half)
        return super().apply(x)
