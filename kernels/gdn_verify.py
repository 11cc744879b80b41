"""Gated DeltaNet (GDN) multi-token state update from a state slot: plain
decode (T = 1), speculative verification (T = γ + 1) and prefill, writing
snapshots into slots; and its log replay.

Symbols (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks", eq. 10; the
layout of Qwen3-Next / Qwen3.5):
    q_t, k_t  [d_k]           query and key of the head's key group, L2-normalised;
                              q_t already scaled by d_k^-1/2 (the caller does both)
    v_t       [d_v]           the value head's input
    g_t       scalar <= 0     log decay, = -exp(A_log) · softplus(a_t + dt_bias)
    β_t       scalar in (0,1) write strength, = sigmoid(b_t)
    S_t       [d_k, d_v]      the state after token t (one per value head)

    S'  = exp(g_t) · S_{t-1}                              (decay)
    u_t = β_t · (v_t − S'ᵀ k_t)                           (delta: what k_t should read, minus what it reads)
    S_t = S' + k_t ⊗ u_t                                  (state update)
    o_t = S_tᵀ q_t                                        (output, before the gated norm)

Value heads share key heads in groups (h_v // (HV // HK) is h_v's key head),
as Mamba-2's heads share B and C.

Slots index a per-layer state pool `states [num_slots, HV, d_k, d_v]`, with
`mamba2_verify`'s slot semantics: row b starts from `src_slot[b]`, the state
after input t goes to `snap_slot[b, t]` unless -1 (it may be the source slot,
which is read first), inputs t >= num_tokens[b] are ignored and their o rows
are zero. The torch references take the forward's `SlotPlan` as `plan=`
instead of the slot tensors.
"""
from __future__ import annotations

import torch

from .mamba2_verify import (FLOAT_DTYPES, accumulate_dtype, as_dtype, check_ndim, check_slot_tensors,
                            check_tensor, slot_plan_for)
from .ssm_replay import check_replay_slots

FROM_POOL = " with sizes from states [num_slots, HV, d_k, d_v]"


def check_gdn_inputs(states, k, v, g, beta, q=None):
    """Check the state pool and the per-token inputs shared by verify and replay."""
    check_ndim("states", states, 4, "[num_slots, HV, d_k, d_v]")
    check_ndim("k", k, 4, "[batch, T, HK, d_k]")
    heads, d_k, d_v = states.shape[1:]
    batch, num_inputs, key_heads = k.shape[:3]
    if key_heads < 1 or heads % key_heads:
        raise ValueError(f"k has {key_heads} key heads, which must divide the {heads} value heads of states")
    device = states.device
    check_tensor("states", states, states.shape, FLOAT_DTYPES, device)
    inputs = {
        "k": (k, (batch, num_inputs, key_heads, d_k), "[batch, T, HK, d_k]"),
        "v": (v, (batch, num_inputs, heads, d_v), "[batch, T, HV, d_v]"),
        "g": (g, (batch, num_inputs, heads), "[batch, T, HV]"),
        "beta": (beta, (batch, num_inputs, heads), "[batch, T, HV]"),
    }
    if q is not None:
        inputs["q"] = (q, (batch, num_inputs, key_heads, d_k), "[batch, T, HK, d_k]")
    for name, (tensor, shape, layout) in inputs.items():
        check_tensor(name, tensor, shape, FLOAT_DTYPES, device, f"= {layout}{FROM_POOL}")


def gdn_step_ref(state, k, v, g, beta):
    """One token of the gated delta rule for every row, in place on `state`
    [batch, HV, d_k, d_v]; k [batch, HV, d_k] (already one per value head),
    v [batch, HV, d_v], g, beta [batch, HV]. Returns the updated state."""
    state.mul_(torch.exp(g)[..., None, None])  # S' = exp(g) S
    read = torch.matmul(k[:, :, None, :], state)[:, :, 0]  # S'ᵀ k  [batch, HV, d_v]
    u = (v - read) * beta[..., None]  # β (v − S'ᵀ k)
    return state.add_(k[..., :, None] * u[..., None, :])  # S' + k ⊗ u


def per_value_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, T, HK, d] -> [batch, T, HV, d]: each key head repeated for its group of value heads."""
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def gdn_verify_ref(states, src_slot, snap_slot, q, k, v, g, beta, num_tokens, plan=None):
    """Advance each row's state from its source slot over its live inputs,
    writing the snapshots the plan names (see the module docstring).

    states [num_slots, HV, d_k, d_v] (written in place)
    q, k [batch, T, HK, d_k]   v [batch, T, HV, d_v]   g, beta [batch, T, HV]
    src_slot [batch], snap_slot [batch, T], num_tokens [batch] int64, or plan=
    Returns o [batch, T, HV, d_v] in v's dtype, before the gated norm.
    """
    check_gdn_inputs(states, k, v, g, beta, q)
    batch, num_inputs, heads = v.shape[:3]
    check_slot_tensors(src_slot, snap_slot, num_tokens, batch, num_inputs, states.device)
    plan = slot_plan_for(plan, src_slot, snap_slot, num_tokens, batch, num_inputs)
    acc = accumulate_dtype(states, q, k, v, g, beta)
    out_dtype = v.dtype
    q, k = (as_dtype(per_value_head(x, heads), acc) for x in (q, k))
    v, g, beta = (as_dtype(x, acc) for x in (v, g, beta))
    state = as_dtype(plan.read(states), acc).clone()  # [batch, HV, d_k, d_v]
    o = torch.zeros_like(v)  # [batch, T, HV, d_v]
    for t, writes in enumerate(plan.steps):
        stepped = gdn_step_ref(state.clone(), k[:, t], v[:, t], g[:, t], beta[:, t])
        state = stepped if plan.all_live else torch.where(plan.is_live[:, t, None, None, None], stepped, state)
        o[:, t] = torch.matmul(q[:, t, :, None, :], state)[:, :, 0]  # Sᵀ q  [batch, HV, d_v]
        if writes is not None:
            writes.write(states, state)
    if not plan.all_live:
        o.masked_fill_(plan.dead_inputs[..., None], 0.0)
    return as_dtype(o, out_dtype)


def gdn_replay_ref(states, src_slot, dst_slot, num_steps, k, v, g, beta):
    """Log replay: advance the state in src_slot[b] over logged inputs
    0 .. num_steps[b] - 1 (k [batch, T, HK, d_k], v [batch, T, HV, d_v],
    g, beta [batch, T, HV]) and write it to dst_slot[b]; rows with dst_slot -1
    untouched, num_steps 0 copies the state, dst may equal src. The state does
    not depend on q, so the log need not hold it."""
    check_gdn_inputs(states, k, v, g, beta)
    batch, num_inputs, heads = v.shape[:3]
    check_replay_slots(states, src_slot, dst_slot, num_steps, batch)
    acc = accumulate_dtype(states, k, v, g, beta)
    k = as_dtype(per_value_head(k, heads), acc)
    v, g, beta = (as_dtype(x, acc) for x in (v, g, beta))
    state = as_dtype(states.index_select(0, src_slot), acc)  # [batch, HV, d_k, d_v] (a copy)
    steps = num_steps.clamp(0, num_inputs)
    for t in range(num_inputs):
        live = t < steps  # [batch]
        stepped = gdn_step_ref(state.clone(), k[:, t], v[:, t], g[:, t], beta[:, t])
        state = torch.where(live[:, None, None, None], stepped, state)
    writes = dst_slot >= 0
    states.index_copy_(0, dst_slot[writes], state[writes].to(states.dtype))
