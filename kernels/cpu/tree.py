"""The tree forms of the conv window and the recurrences in C (Mamba-2,
Mamba-1, the gated delta rule): what `ops.NativeTreeForms` runs for a tree
forward that goes layer by layer on float32 CPU tensors, in place of the
torch forms (`kernels/triton/tree_verify.py`).

Why: the torch forms step a tree depth level by depth level in whole-state
torch operations; the C loops (`cpu/conv.c`, `cpu/mamba2.c`, `cpu/mamba1.c`,
`cpu/gdn.c`) take each input's parent index and run a row's inputs in one
pass, each input from its parent's state with the chain's own step, so an
input's outputs and state are the native chain's along its path, bit for bit.

`tree_steps` runs any of those loops with the torch forms' arguments: the
pool and the forward's `SlotPlan` (the head slots), the tree (`TreePlan`:
`batch`, `num_inputs`, `parents`), the inputs; it returns (outputs [batch, T,
...], every input's state [batch, T, ...], zero on padding). The states are computed in a buffer of
T + 1 states per row (the head copied first, then input t's at t + 1), which
the caller keeps (`cache.tree_batch`); no ring slot is written.
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridspec.kernels.slot_plan import SlotPlan


class Buffer:
    """The states of one tree forward: `pool` [batch · (T + 1), ...] (row b's head at
    b·(T + 1), input t's state at b·(T + 1) + 1 + t), `plan` the SlotPlan over it,
    `parents` [batch, T] int64 (padding inputs: -1)."""

    def __init__(self, states: torch.Tensor, slots: SlotPlan, tree):
        B, T = tree.batch, tree.num_inputs
        self.shape = (B, T + 1, *states.shape[1:])
        self.pool = states.new_zeros(B * (T + 1), *states.shape[1:])
        self.pool[::T + 1] = slots.read(states)
        self.plan = SlotPlan([b * (T + 1) for b in range(B)],
                             [[b * (T + 1) + 1 + t for t in range(T)] for b in range(B)],
                             [len(p) for p in tree.parents], "cpu")
        self.parents = torch.tensor([p + [-1] * (T - len(p)) for p in tree.parents], dtype=torch.long)

    def states(self) -> torch.Tensor:  # [batch, T, ...] each input's state
        return self.pool.view(self.shape)[:, 1:]


def tree_steps(steps: Callable[..., torch.Tensor], states: torch.Tensor, slots: SlotPlan, tree,
               *inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A C chain loop `steps(pool, plan, *inputs, parents)` (`conv.conv_window_steps`,
    `mamba2.mamba2_steps`, `mamba1.mamba1_steps`, `gdn.gdn_steps`) run over the tree from each
    row's head state in `states`: (its outputs [batch, T, ...], every input's state [batch, T, ...])."""
    buffer = Buffer(states, slots, tree)
    out = steps(buffer.pool, buffer.plan, *inputs, buffer.parents)
    return out, buffer.states()
