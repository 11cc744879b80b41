"""The input log of a gated DeltaNet layer: per verify input, what log replay
needs to rebuild the state and the conv window without the model
(docs/design.md, "input log"): the conv inputs xs and the rule's k, v, g, β.
The state does not depend on q, so q is not kept. Its size per input is
`GdnStateSpec.log_bytes_per_input` (`hybridspec.cache.state_specs`). The
checkpoints see it only as a `LayerInputLog` (`nbytes`); the layer's replay
(`kernels.ops.GdnLogReplay`) reads its fields."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GdnInputLog:
    xs: torch.Tensor  # [batch, T, conv_dim] conv inputs [q | k | v] before the conv (model dtype)
    k: torch.Tensor  # [batch, T, HK, d_k] L2-normalised keys (model dtype)
    v: torch.Tensor  # [batch, T, HV, d_v] values (model dtype)
    g: torch.Tensor  # [batch, T, HV] log decays (state dtype)
    beta: torch.Tensor  # [batch, T, HV] write strengths (state dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.xs, self.k, self.v, self.g, self.beta))

    def shifted(self, first: torch.Tensor) -> "GdnInputLog":
        """The log with row b starting at input first[b] (tail padded with the last input)."""
        T = self.xs.shape[1]
        return self.along((first[:, None] + torch.arange(T, device=first.device)).clamp(max=T - 1))

    def along(self, inputs: torch.Tensor) -> "GdnInputLog":
        """The log whose row b's input k is this log's input inputs[b, k] (inputs [batch, K] int64):
        a tree round's accepted path in path order, or a shifted chain."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            index = inputs.view(*inputs.shape, *([1] * (t.dim() - 2))).expand(*inputs.shape, *t.shape[2:])
            return t.gather(1, index).contiguous()

        return GdnInputLog(*(pick(t) for t in (self.xs, self.k, self.v, self.g, self.beta)))
