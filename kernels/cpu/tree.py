"""The tree forms of the conv window and the recurrences in C (Mamba-2,
Mamba-1, the gated delta rule): what `ops.NativeTreeForms` runs for a tree
forward that goes layer by layer on float32 CPU tensors, in place of the
torch forms (`kernels/triton/tree_verify.py`).

Why: the torch forms step a tree depth level by depth level in whole-state
torch operations; the C loops (`cpu/conv.c`, `cpu/mamba2.c`, `cpu/mamba1.c`,
`cpu/gdn.c`) take each input's parent index and run a row's inputs in one
pass, each input from its parent's state with the chain's own step, so an
input's outputs and state are the native chain's along its path, bit for bit.

Same arguments and results as the torch forms: the pool and the forward's
`SlotPlan` (the head slots), the tree (`TreePlan`: `batch`, `num_inputs`,
`parents`), the inputs; returns (outputs [batch, T, ...], every input's state
[batch, T, ...], zero on padding). The states are computed in a buffer of
T + 1 states per row (the head copied first, then input t's at t + 1), which
the caller keeps (`cache.tree_batch`); no ring slot is written.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.cpu import conv as cpu_conv
from hybridspec.kernels.cpu import gdn as cpu_gdn
from hybridspec.kernels.cpu import mamba1 as cpu_mamba1
from hybridspec.kernels.cpu import mamba2 as cpu_mamba2
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


def conv_window_applies(conv_states, slots, xs, weight, bias, activation) -> bool:
    return cpu_conv.applies(conv_states, xs, weight, bias, activation, slots)


def conv_window_tree(conv_states, slots, tree, xs, weight, bias, activation) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_states [slots, conv_dim, d_conv - 1]; xs [batch, T, conv_dim]; weight [conv_dim, d_conv]
    -> (out [batch, T, conv_dim], windows [batch, T, conv_dim, d_conv - 1])."""
    buffer = Buffer(conv_states, slots, tree)
    out = cpu_conv.conv_window_steps(buffer.pool, buffer.plan, xs, weight, bias, activation, buffer.parents)
    return out, buffer.states()


def mamba2_applies(ssm_states, slots, x) -> bool:
    return cpu_mamba2.applies(ssm_states, x, slots)


def mamba2_tree(ssm_states, slots, tree, x, dt, A, B, C, D) -> tuple[torch.Tensor, torch.Tensor]:
    """ssm_states [slots, nheads, headdim, d_state]; x [batch, T, nheads, headdim]; dt [batch, T, nheads];
    B, C [batch, T, ngroups, d_state]
    -> (y [batch, T, nheads, headdim], states [batch, T, nheads, headdim, d_state])."""
    buffer = Buffer(ssm_states, slots, tree)
    y = cpu_mamba2.mamba2_steps(buffer.pool, buffer.plan, x, dt, A, B, C, D, buffer.parents)
    return y, buffer.states()


def mamba1_applies(ssm_states, slots, x) -> bool:
    return cpu_mamba1.applies(ssm_states, x, slots)


def mamba1_tree(ssm_states, slots, tree, x, dt, A, B, C, D) -> tuple[torch.Tensor, torch.Tensor]:
    """ssm_states [slots, d_inner, d_state]; x, dt [batch, T, d_inner]; B, C [batch, T, d_state]
    -> (y [batch, T, d_inner], states [batch, T, d_inner, d_state])."""
    buffer = Buffer(ssm_states, slots, tree)
    y = cpu_mamba1.mamba1_steps(buffer.pool, buffer.plan, x, dt, A, B, C, D, buffer.parents)
    return y, buffer.states()


def gdn_applies(states, slots, v) -> bool:
    return cpu_gdn.applies(states, v, slots)


def gdn_tree(states, slots, tree, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """states [slots, HV, d_k, d_v]; q, k [batch, T, HK, d_k]; v [batch, T, HV, d_v]; g, beta [batch, T, HV]
    -> (o [batch, T, HV, d_v], states [batch, T, HV, d_k, d_v])."""
    buffer = Buffer(states, slots, tree)
    o = cpu_gdn.gdn_steps(buffer.pool, buffer.plan, q, k, v, g, beta, buffer.parents)
    return o, buffer.states()
