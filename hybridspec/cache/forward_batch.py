"""The metadata one forward carries through the layer stack (one explicit
argument, never globals)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridspec.kernels.slot_plan import SlotPlan

if TYPE_CHECKING:  # a forward carries the checkpoints' log; the cache never builds one
    from hybridspec.checkpoints.input_log import InputLog
    from hybridspec.cache.hidden_states import HiddenCapture
    from hybridspec.cache.tree_batch import TreeBatch


@dataclass
class ForwardBatch:
    """A ragged batch, rows right-padded to T inputs.

    Every Mamba layer starts from the state in `src_slot` (the ring head) and
    writes the state after input t into `snap_slot[b, t]` (-1: no write); the
    host-side `slots` plan says the same for the torch paths. Attention writes
    K/V at `kv.slot_mapping` and attends over `kv.context_lens`. Tensors are
    made on first use and shared by every layer.
    """

    slots: SlotPlan  # state slots read and written, worked out on the host
    start_lens: list[int]  # computed length of each row before the forward: input t sits at start + t
    kv: object | None  # KVWriteMeta from PagedKVCache.prepare_write; None without attention layers
    input_log: InputLog | None = field(default=None)  # Mamba layer -> its log, filled when not None
    hidden: HiddenCapture | None = None  # the hidden states a drafter reads (`cache.hidden_states`), when not None
    final_state_only: bool = False  # only the state after each row's last input is wanted (prefill, plain extend)
    shared: dict = field(default_factory=dict)  # per-forward values every layer of a kind reuses (rotary angles)
    tree: TreeBatch | None = None  # the inputs form a tree (`cache.tree_batch`): the mixers run its forms

    @property
    def batch_size(self) -> int:
        return self.slots.batch

    @property
    def num_tokens(self) -> torch.Tensor:  # [batch] valid inputs per row
        return self.slots.num_tokens

    @property
    def src_slot(self) -> torch.Tensor:  # [batch] int64
        return self.slots.src

    @property
    def snap_slot(self) -> torch.Tensor:  # [batch, T] int64
        return self.slots.snap

    @functools.cached_property
    def positions(self) -> torch.Tensor:  # [batch, T] absolute position of each input (a tree's: start + depth)
        if self.tree is not None:
            return self.tree.positions(self.start_lens)
        T = self.slots.num_inputs
        return torch.tensor([[s + t for t in range(T)] for s in self.start_lens], dtype=torch.long,
                            device=self.slots.device).view(self.slots.batch, T)
