"""`TreeBatch`: what a forward over a tree of inputs carries through the
layer stack (`ForwardBatch.tree`) and hands back to the round: the tree's
indices (`cache.tree_plan.TreePlan`), the inputs' states written to the ring
slots the forward's plan names, and, only when asked (`keep_states`), every
input's state per recurrent layer beside the ring.

The mixers call its `window` and `recurrence` with their backend's tree forms
(`Backend.tree_forms`) in place of their chain ops when a forward runs over
a tree, and attention the tree form of attention over `plan` (C recurrences
on the native backend, Triton kernels on the Triton one, the torch forms as
references; CUDA graphs take chains only).
Each layer's form returns every input's state; the inputs with a snapshot
slot (`slots.snap`, planned by `Checkpointer.plan_tree` under the round's
checkpoint policy) are written there and the rest dropped, so a round holds
only the snapshots its policy chose (the accepted input without one is
replayed along its path at the commit). The whole C forward
(`kernels/cpu/forward.py`) takes a tree whose every input has a snapshot slot
and writes each input's state there itself (`in_ring`). K/V go where a
chain's would (input t at position start + t) and are moved onto the
accepted path at the commit.
"""
from __future__ import annotations

import functools

import torch

from hybridspec.cache.tree_plan import TreePlan
from hybridspec.kernels.slot_plan import SlotPlan


class TreeBatch:
    """parents [batch][n_b]: each verify input's parent input, -1 for input 0 (the
    pending token); `slots`: the forward's SlotPlan (set by `HybridCache.plan_forward`);
    `keep_states`: also keep every input's state here (`ssm`, `conv`), for a caller that
    reads each input's state (a round keeps only its snapshots: False)."""

    def __init__(self, parents: list[list[int]], device, keep_states: bool = True):
        self.plan = TreePlan(parents, device)
        self.slots: SlotPlan | None = None
        self.keep_states = keep_states
        self.ssm: dict[int, torch.Tensor] = {}  # state_layer -> [batch, T, ...] the state after each input
        self.conv: dict[int, torch.Tensor] = {}  # state_layer -> [batch, T, conv_dim, d_conv - 1]
        self.in_ring = False  # the whole C forward wrote every input's state to its snapshot slot

    def positions(self, start_lens: list[int]) -> torch.Tensor:  # [batch, T] start + depth
        return self.plan.positions(start_lens)

    # -- what the mixers call --------------------------------------------------------------

    def window(self, layer: int, tree_form, conv_states, *inputs) -> torch.Tensor:
        """A conv window over the tree: `tree_form(conv_states, slots, plan, *inputs)`
        (`TreeForms.conv_window`) gives (outputs, every input's window)."""
        out, windows = tree_form(conv_states, self.slots, self.plan, *inputs)
        self._snapshot(conv_states, windows, self.conv, layer)
        return out

    def recurrence(self, layer: int, tree_form, states, *inputs) -> torch.Tensor:
        """A recurrent layer's rule over the tree: `tree_form(states, slots, plan, *inputs)`,
        its kind's form (`Backend.tree_forms`), gives (outputs, every input's state)."""
        out, node_states = tree_form(states, self.slots, self.plan, *inputs)
        self._snapshot(states, node_states, self.ssm, layer)
        return out

    def _snapshot(self, pool: torch.Tensor, node_states: torch.Tensor, kept: dict, layer: int) -> None:
        """node_states [batch, T, ...]: the planned inputs' into their pool slots (never a head:
        the plan's), all of them into `kept` when asked."""
        rows, inputs, slots = self._snapshots
        if slots.numel():
            pool.index_copy_(0, slots, node_states[rows, inputs].to(pool.dtype))
        if self.keep_states:
            kept[layer] = node_states

    @functools.cached_property
    def _snapshots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, inputs, slots) [snapshots] of the live inputs the forward's plan gives a slot."""
        picks = [(b, t, slot) for b, row in enumerate(self.slots.live_snap_list) for t, slot in enumerate(row)
                 if slot >= 0]
        columns = list(zip(*picks)) if picks else ([], [], [])
        return tuple(torch.tensor(c, dtype=torch.long, device=self.plan.device) for c in columns)

    # -- what the round counts ------------------------------------------------------------

    def nbytes(self) -> int:
        """The bytes of the kept states (what a tree forward holds beside the ring)."""
        return sum(t.numel() * t.element_size() for t in (*self.ssm.values(), *self.conv.values()))
