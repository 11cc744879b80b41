"""The metadata one forward carries through the layer stack (one explicit
argument, never globals)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridspec.checkpoints.input_log import InputLog


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
    input_log: InputLog | None = field(default=None)  # Mamba layer -> its log, filled when not None
    final_state_only: bool = False  # only the state after each row's last input is wanted (prefill, plain extend)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]
