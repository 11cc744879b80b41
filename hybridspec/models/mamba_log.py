"""The input log of the Mamba kinds (Mamba-1 and Mamba-2): the per-input mixer
inputs of one layer for one verify forward, enough to log-replay the
recurrence and the conv window to any boundary without the model
(docs/design.md, "input log"). Its size per input is
`hybridspec.cache.state_specs.log_bytes_per_input`. The checkpoints see it only as
a `LayerInputLog` (`nbytes`); the layer's own replay reads its fields."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MambaInputLog:
    xs: torch.Tensor  # [batch, T, conv_dim] conv inputs (model dtype)
    x: torch.Tensor  # [batch, T, nheads, headdim] | [batch, T, d_inner] SSM inputs after conv + activation
    dt: torch.Tensor  # [batch, T, nheads | d_inner] processed time steps (state dtype)
    B: torch.Tensor  # [batch, T, (ngroups,) d_state]
    C: torch.Tensor  # [batch, T, (ngroups,) d_state]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.xs, self.x, self.dt, self.B, self.C))

    def shifted(self, first: torch.Tensor) -> "MambaInputLog":
        """The log with row b starting at input first[b] (tail padded with the last input)."""
        T = self.xs.shape[1]
        return self.along((first[:, None] + torch.arange(T, device=first.device)).clamp(max=T - 1))

    def along(self, inputs: torch.Tensor) -> "MambaInputLog":
        """The log whose row b's input k is this log's input inputs[b, k] (inputs [batch, K] int64):
        a tree round's accepted path in path order, or a shifted chain."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            index = inputs.view(*inputs.shape, *([1] * (t.dim() - 2))).expand(*inputs.shape, *t.shape[2:])
            return t.gather(1, index).contiguous()

        return MambaInputLog(*(pick(t) for t in (self.xs, self.x, self.dt, self.B, self.C)))
