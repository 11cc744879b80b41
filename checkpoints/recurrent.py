"""`RecurrentLayer`: what a layer with recurrent state offers the checkpoints.

The checkpoints (`Checkpointer`, `restore`, `costs`) reach a model's recurrent
state only through `HybridModel.recurrent_layers`, a list of these; they never
look inside a model's layer stack. Mamba1 and Mamba2 mixers implement it; a new
recurrent layer kind implements it to get snapshots, rollback and replay.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hybridspec.checkpoints.input_log import MambaInputLog
from hybridspec.checkpoints.state_pool import StatePool
from hybridspec.state_memory import RecurrentStateShape


@runtime_checkable
class RecurrentLayer(Protocol):
    state_layer: int  # this layer's storage in the StatePool (its index among the recurrent layers)
    state_shape: RecurrentStateShape  # one ring slot's SSM state and conv window, and its log width

    def forward(self, h: torch.Tensor, batch, cache) -> torch.Tensor:
        """The multi-step update: advance the state in `batch.src_slot` over the
        batch's inputs, writing the state after input t to `batch.snap_slot[:, t]`
        (-1: none) and, when `batch.input_log` is a dict, its inputs there."""
        ...

    def replay(self, states: StatePool, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: MambaInputLog) -> None:
        """Advance the state in src_slot[b] over logged inputs first[b] ..
        first[b] + num_steps[b] - 1 and write it to dst_slot[b] (rows with
        dst_slot -1 untouched). Every index tensor is [batch] int64."""
        ...
