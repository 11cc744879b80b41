"""`TreeBatch`: what a forward over a tree of inputs carries through the
layer stack (`ForwardBatch.tree`) and hands back to the round: the tree's
indices (`cache.tree_plan.TreePlan`) and, per recurrent layer, the state
after every input, kept until the commit copies the accepted input's into a
ring slot (`write_input`).

The mixers call its `window` and `recurrence` with their backend's tree forms
(`Backend.tree_forms`) in place of their chain ops when a forward runs over
a tree, and attention the tree form of attention over `plan` (C recurrences
on the native backend, Triton kernels on the Triton one, the torch forms as
references; CUDA graphs take chains only). Those write no ring slot. The whole C forward (`kernels/cpu/forward.py`)
takes a tree whose every input has a snapshot slot and writes each input's
state there instead (`in_ring`): the commit then moves the ring head. K/V go
where a chain's would (input t at position start + t) and are moved onto the
accepted path at the commit.
"""
from __future__ import annotations

import torch

from hybridspec.cache.tree_plan import TreePlan
from hybridspec.kernels.slot_plan import SlotPlan


class TreeBatch:
    """parents [batch][n_b]: each verify input's parent input, -1 for input 0 (the
    pending token); `slots`: the forward's SlotPlan (set by `HybridCache.plan_forward`)."""

    def __init__(self, parents: list[list[int]], device):
        self.plan = TreePlan(parents, device)
        self.slots: SlotPlan | None = None
        self.ssm: dict[int, torch.Tensor] = {}  # state_layer -> [batch, T, ...] the state after each input
        self.conv: dict[int, torch.Tensor] = {}  # state_layer -> [batch, T, conv_dim, d_conv - 1]
        self.in_ring = False  # every input's state is in its snapshot slot (`slots.snap`), not here

    def states_in_ring(self) -> None:
        """Say the forward wrote every input's state to its snapshot slot (the whole C forward)."""
        self.in_ring = True

    def positions(self, start_lens: list[int]) -> torch.Tensor:  # [batch, T] start + depth
        return self.plan.positions(start_lens)

    # -- what the mixers call --------------------------------------------------------------

    def window(self, layer: int, tree_form, conv_states, *inputs) -> torch.Tensor:
        """A conv window over the tree: `tree_form(conv_states, slots, plan, *inputs)`
        (`TreeForms.conv_window`) gives (outputs, every input's window)."""
        out, self.conv[layer] = tree_form(conv_states, self.slots, self.plan, *inputs)
        return out

    def recurrence(self, layer: int, tree_form, states, *inputs) -> torch.Tensor:
        """A recurrent layer's rule over the tree: `tree_form(states, slots, plan, *inputs)`,
        its kind's form (`Backend.tree_forms`), gives (outputs, every input's state)."""
        out, self.ssm[layer] = tree_form(states, self.slots, self.plan, *inputs)
        return out

    # -- what the commit reads -------------------------------------------------------------

    def write_input(self, ssm_states: list[torch.Tensor], conv_states: list[torch.Tensor], b: int, t: int,
                    slot: int) -> None:
        """Every recurrent layer's state after row b's input t into pool slot `slot`."""
        for layer, states in self.ssm.items():
            ssm_states[layer][slot].copy_(states[b, t])
        for layer, windows in self.conv.items():
            conv_states[layer][slot].copy_(windows[b, t])

    def nbytes(self) -> int:
        """The bytes of every input's kept states (what a tree round holds beside the ring)."""
        return sum(t.numel() * t.element_size() for t in (*self.ssm.values(), *self.conv.values()))
