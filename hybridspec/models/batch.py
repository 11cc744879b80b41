"""The metadata one forward carries through the layer stack (one explicit
argument, never globals)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MambaInputLog:
    """Per-token mixer inputs of one Mamba layer for one verify forward: enough
    to log-replay the recurrence to any boundary without the model."""

    xs: torch.Tensor  # [batch, T, conv_dim] conv inputs
    x: torch.Tensor  # [batch, T, ...] SSM inputs (after conv + activation)
    dt: torch.Tensor  # [batch, T, nheads | d_inner] processed time steps
    B: torch.Tensor  # [batch, T, (ngroups,) d_state]
    C: torch.Tensor  # [batch, T, (ngroups,) d_state]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.xs, self.x, self.dt, self.B, self.C))

    def shifted(self, first: torch.Tensor) -> "MambaInputLog":
        """The log with row b starting at input first[b] (tail padded with the last input)."""
        T = self.x.shape[1]
        idx = (first[:, None] + torch.arange(T, device=first.device)).clamp(max=T - 1)  # [batch, T]

        def shift(t: torch.Tensor) -> torch.Tensor:
            index = idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand_as(t)
            return t.gather(1, index).contiguous()

        return MambaInputLog(*(shift(t) for t in (self.xs, self.x, self.dt, self.B, self.C)))


@dataclass
class ForwardBatch:
    """A ragged batch, rows right-padded to T inputs.

    Every Mamba layer starts from the state in `src_slot` (the ring head) and
    writes the state after input t into `snap_slot[b, t]` (-1: no write).
    Attention writes K/V at `kv.slot_mapping` and attends over `kv.context_lens`.
    """

    positions: torch.Tensor  # [batch, T] absolute position of each input
    num_tokens: torch.Tensor  # [batch] valid inputs per row
    kv: object | None  # KVWriteMeta from PagedKVCache.prepare_write; None without attention layers
    src_slot: torch.Tensor  # [batch] int64
    snap_slot: torch.Tensor  # [batch, T] int64
    input_log: dict[int, MambaInputLog] | None = field(default=None)  # layer -> log, filled when not None
    final_state_only: bool = False  # only the state after each row's last input is wanted (prefill, plain extend)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]
