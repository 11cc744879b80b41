"""`RecurrentLayer`: what a layer with recurrent state offers the checkpoints.

The checkpoints (`Checkpointer`, `restore`, `costs`) reach a model's recurrent
state only through `HybridModel.recurrent_layers`, a list of these, and the
state pool's slots; they never look inside a model's layer stack, nor at what
a layer logs. The Mamba-1 and Mamba-2 mixers implement it; a new recurrent
layer kind (gated DeltaNet) implements it to get snapshots, rollback and
replay, with no change to checkpoints/, cache/ or spec/:
- its state: `state_spec` (one ring slot's recurrent state and conv
  window, and its log width: what `StatePool` allocates and
  `state_specs` counts the bytes of) at `state_layer` in the pool;
- the multi-step update from the head (`forward`): prefill from an empty
  (zeroed) slot, a decode step and a verify are the same call, writing the
  snapshots the plan names and, when asked, its input log;
- log replay (`replay`) from any slot over its own log;
- a descriptor for the native kernels (`describe`, `kernels.descriptors`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hybridspec.checkpoints.input_log import LayerInputLog
from hybridspec.cache.state_pool import StatePool
from hybridspec.cache.state_specs import RecurrentStateSpec


@runtime_checkable
class RecurrentLayer(Protocol):
    state_layer: int  # this layer's storage in the StatePool (its index among the recurrent layers)
    state_spec: RecurrentStateSpec  # one ring slot's SSM state and conv window, and its log width

    def forward(self, h: torch.Tensor, batch, cache) -> torch.Tensor:
        """The multi-step update: advance the state in `batch.src_slot` over the
        batch's inputs (a zeroed slot for a prefill), writing the state after
        input t to `batch.snap_slot[:, t]` (-1: none) and, when `batch.input_log`
        is a dict, its own log there at `state_layer`."""
        ...

    def replay(self, states: StatePool, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: LayerInputLog) -> None:
        """Advance the state in src_slot[b] over logged inputs first[b] ..
        first[b] + num_steps[b] - 1 and write it to dst_slot[b] (rows with
        dst_slot -1 untouched), `log` the one its own forward wrote. Every index
        tensor is [batch] int64."""
        ...
