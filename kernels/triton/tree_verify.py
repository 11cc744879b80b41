"""The torch forms of a forward over a tree of inputs: the references of
tree verification, which a tree forward that runs layer by layer runs on the
torch backend (`ops.TreeForms`); the Triton kernels beside them take the same
arguments (`tree_recurrences.py`, `tree_attention.py`), the native backend has
C loops (`cpu/tree.py`) and the whole C forward its own (`cpu/forward.c`).
Each recurrence (the conv window, Mamba-2, Mamba-1, the gated delta rule)
steps every input from its parent's state, depth level by depth level
(`tree_scan`), and attention masks each input to the committed context and
its ancestors (`tree_attention_ref`). No ring slot is written: every input's
state comes back, [batch, T, ...] in the accumulation dtype, for the caller
to keep the accepted input's (`cache.tree_batch.TreeBatch`).

`tree` is the forward's `TreePlan` (hybridspec/cache/tree_plan.py, read as
`batch`, `num_inputs`, `levels` and `visible`: the kernels sit below the
cache). Each `*_tree_ref` takes the pool and the forward's `SlotPlan` (for
the head slots it starts from) and the tree, and returns (outputs [batch, T,
...] in the inputs' dtype, zero on padding; states [batch, T, ...]). The
per-step rules are the chain references' own (`mamba2_step_ref`,
`mamba1_step_ref`, `gdn_step_ref`), so a chain's tree form computes what
the chain forward does, step for step.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hybridspec.kernels.slot_plan import SlotPlan
from hybridspec.kernels.triton.gdn_verify import gdn_step_ref, per_value_head
from hybridspec.kernels.triton.mamba1_verify import mamba1_step_ref
from hybridspec.kernels.triton.mamba2_verify import accumulate_dtype, as_dtype, mamba2_step_ref
from hybridspec.kernels.triton.paged_attention import row_pages

# (parent states [n, ...], each input [n, ...]) -> (states [n, ...], outputs [n, ...])
Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def tree_scan(init: torch.Tensor, tree, step: Step,
              *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `step` over the tree from `init` [batch, ...] (each row's head state):
    every input's state from its parent's, one call per depth level.
    inputs: each [batch, T, ...]. Returns (states [batch, T, ...], outs [batch, T, ...], zero on padding)."""
    B, T = tree.batch, tree.num_inputs
    buffer = init.new_zeros(B, T + 1, *init.shape[1:])  # [batch, T + 1, ...]: head, then input t's state
    buffer[:, 0] = init
    flat = buffer.view(B * (T + 1), *init.shape[1:])
    flat_inputs = [x.reshape(B * T, *x.shape[2:]) for x in inputs]
    outs = None
    for nodes, sources, own in tree.levels:
        states, out = step(flat.index_select(0, sources), *(x.index_select(0, nodes) for x in flat_inputs))
        flat.index_copy_(0, own, states)
        if outs is None:
            outs = out.new_zeros(B * T, *out.shape[1:])
        outs.index_copy_(0, nodes, out)
    return buffer[:, 1:], outs.view(B, T, *outs.shape[1:])


def conv_window_tree_ref(conv_states: torch.Tensor, slots: SlotPlan, tree, xs: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_states [slots, conv_dim, d_conv - 1]; xs [batch, T, conv_dim]; weight [conv_dim, d_conv]
    -> (out [batch, T, conv_dim], windows [batch, T, conv_dim, d_conv - 1])."""
    acc = accumulate_dtype(conv_states, xs, weight, bias)
    weight = as_dtype(weight, acc)

    def step(window, x):  # window [n, conv_dim, d_conv - 1], x [n, conv_dim]
        ext = torch.cat([window, x[..., None]], dim=2)  # [n, conv_dim, d_conv]
        out = (ext * weight).sum(-1)
        if bias is not None:
            out = out + as_dtype(bias, acc)
        return ext[:, :, 1:], F.silu(out) if activation == "silu" else out

    windows, out = tree_scan(as_dtype(slots.read(conv_states), acc), tree, step, as_dtype(xs, acc))
    return as_dtype(out, xs.dtype), windows


def mamba2_tree_ref(ssm_states: torch.Tensor, slots: SlotPlan, tree, x, dt, A, B, C,
                D) -> tuple[torch.Tensor, torch.Tensor]:
    """h = exp(Δ A) h_parent + Δ x ⊗ B, y = h C + D x per input. ssm_states [slots, nheads, headdim, d_state];
    x [batch, T, nheads, headdim]; dt [batch, T, nheads]; B, C [batch, T, ngroups, d_state]
    -> (y [batch, T, nheads, headdim], states [batch, T, nheads, headdim, d_state])."""
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    heads_per_group = x.shape[2] // B.shape[2]
    A, D = as_dtype(A, acc), as_dtype(D, acc)

    def step(state, x, dt, B, C):  # state [n, nheads, headdim, d_state]; B, C [n, ngroups, d_state]
        n, ngroups, d_state = B.shape
        state = mamba2_step_ref(state, x, dt, A, B.repeat_interleave(heads_per_group, dim=1))
        # y = C h in the chain's row-vector form, per group, then + D x
        y = torch.bmm(C.reshape(n * ngroups, 1, d_state),
                      state.reshape(n * ngroups, heads_per_group * x.shape[2], d_state).transpose(1, 2))
        return state, torch.addcmul(y.view_as(x), x, D.view(-1, 1))

    states, y = tree_scan(as_dtype(slots.read(ssm_states), acc), tree, step,
                          *(as_dtype(t, acc) for t in (x, dt, B, C)))
    return as_dtype(y, x.dtype), states


def mamba1_tree_ref(ssm_states: torch.Tensor, slots: SlotPlan, tree, x, dt, A, B, C,
                D) -> tuple[torch.Tensor, torch.Tensor]:
    """h = exp(Δ ⊗ A) ⊙ h_parent + (Δ x) ⊗ B, y = h C + D x per input. ssm_states [slots, d_inner, d_state];
    x, dt [batch, T, d_inner]; B, C [batch, T, d_state]
    -> (y [batch, T, d_inner], states [batch, T, d_inner, d_state])."""
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    A, D = as_dtype(A, acc), as_dtype(D, acc)

    def step(state, x, dt, B, C):  # state [n, d_inner, d_state]
        state = mamba1_step_ref(state, x, dt, A, B)
        y = torch.bmm(C[:, None, :], state.transpose(1, 2))[:, 0]  # y = h C in the chain's row-vector form
        return state, y.addcmul_(D, x)

    states, y = tree_scan(as_dtype(slots.read(ssm_states), acc), tree, step,
                          *(as_dtype(t, acc) for t in (x, dt, B, C)))
    return as_dtype(y, x.dtype), states


def gdn_tree_ref(states: torch.Tensor, slots: SlotPlan, tree, q, k, v, g,
             beta) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule per input from its parent's state. states [slots, HV, d_k, d_v];
    q, k [batch, T, HK, d_k]; v [batch, T, HV, d_v]; g, beta [batch, T, HV]
    -> (o [batch, T, HV, d_v], states [batch, T, HV, d_k, d_v])."""
    acc = accumulate_dtype(states, q, k, v, g, beta)
    heads = v.shape[2]

    def step(state, q, k, v, g, beta):  # state [n, HV, d_k, d_v]
        state = gdn_step_ref(state.clone(), k, v, g, beta)
        return state, torch.matmul(q[:, :, None, :], state)[:, :, 0]  # Sᵀ q  [n, HV, d_v]

    q, k = (as_dtype(per_value_head(t, heads), acc) for t in (q, k))
    node_states, o = tree_scan(as_dtype(slots.read(states), acc), tree, step, q, k,
                               *(as_dtype(t, acc) for t in (v, g, beta)))
    return as_dtype(o, v.dtype), node_states


def tree_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, tree,
                   scale: float) -> torch.Tensor:
    """Attention of q [batch, T, heads, head_dim] over each row's committed K/V
    and its own inputs' (written at positions start .. start + n - 1), input t
    seeing only the inputs `tree.visible` names -> [batch, T, heads, head_dim]."""
    out = torch.zeros_like(q)
    for b, (runs, ctx, n) in enumerate(zip(meta.page_runs, meta.context_list, meta.query_list)):
        k, v = row_pages(k_cache, runs, ctx), row_pages(v_cache, runs, ctx)  # [ctx, kv_heads, head_dim]
        mask = torch.cat([torch.ones(n, ctx - n, dtype=torch.bool, device=q.device), tree.visible[b]], dim=1)
        attended = F.scaled_dot_product_attention(q[b, :n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                                  enable_gqa=True)  # [1, heads, n, head_dim]
        out[b, :n] = attended[0].transpose(0, 1)
    return out
