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
instead of the slot tensors. Slot indices must lie in [0, num_slots) (or be
-1 where allowed); the launchers do not check them, as that would synchronise
with the GPU.

Kernel, launcher and reference per op: `_gdn_verify_kernel`, `gdn_verify`,
`gdn_verify_ref`; `_gdn_replay_kernel`, `gdn_replay`, `gdn_replay_ref`.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.triton.mamba2_verify import (FLOAT_DTYPES, accumulate_dtype, as_dtype, check_kernel_device, check_ndim,
                            check_slot_tensors, check_tensor, slot_plan_for, triton_dtype)
from hybridspec.kernels.triton.ssm_replay import check_replay_slots
from hybridspec.kernels.triton.triton_import import tl, triton

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


def check_gdn_verify_args(states, src_slot, snap_slot, q, k, v, g, beta, num_tokens):
    check_gdn_inputs(states, k, v, g, beta, q)
    check_slot_tensors(src_slot, snap_slot, num_tokens, v.shape[0], v.shape[1], states.device)


def check_gdn_replay_args(states, src_slot, dst_slot, num_steps, k, v, g, beta):
    check_gdn_inputs(states, k, v, g, beta)
    check_replay_slots(states, src_slot, dst_slot, num_steps, v.shape[0])


# ---------------------------------------------------------------------- kernels


@triton.jit
def gdn_state_step(state, k, v, g, beta):
    """S_t = S' + k ⊗ β (v − S'ᵀ k), S' = exp(g) S_{t-1}; state [BLOCK_K, BLOCK_V]
    (a block of the value columns: every column's update reads only itself),
    k [BLOCK_K], v [BLOCK_V], g and β scalars."""
    state = state * tl.exp(g)
    u = (v - tl.sum(state * k[:, None], axis=0)) * beta  # β (v − S'ᵀ k)  [BLOCK_V]
    return state + k[:, None] * u[None, :]


@triton.jit
def gdn_tile(h, heads_per_key, d_k, d_v, stride_state_head, stride_state_k,
             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's offsets: the state tile of value head h at columns
    program_id(2) · BLOCK_V …, its masks, and h's key head."""
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = kk < d_k
    v_mask = vv < d_v
    tile = h * stride_state_head + kk[:, None] * stride_state_k + vv[None, :]
    return kk, vv, k_mask, v_mask, tile, k_mask[:, None] & v_mask[None, :], h // heads_per_key


# No autotuning: the kernel writes state slots in place, and autotune's trial
# runs would advance them several times.
@triton.jit
def _gdn_verify_kernel(
    state_ptr, src_slot_ptr, snap_slot_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, num_tokens_ptr, o_ptr,
    num_inputs, d_k, d_v, heads_per_key,
    stride_state_slot, stride_state_head, stride_state_k,
    stride_qk_b, stride_qk_t, stride_qk_h,
    stride_v_b, stride_v_t, stride_v_h,
    stride_g_b, stride_g_t,
    stride_snap_b,
    ACC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per (batch row, value head, block of d_v); the [d_k, BLOCK_V]
    # state tile stays in registers across the T inputs. Innermost dims are contiguous.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk, vv, k_mask, v_mask, tile, tile_mask, hk = gdn_tile(
        h, heads_per_key, d_k, d_v, stride_state_head, stride_state_k, BLOCK_K, BLOCK_V)
    src = tl.load(src_slot_ptr + b)
    state = tl.load(state_ptr + src * stride_state_slot + tile, mask=tile_mask, other=0.0).to(ACC)
    num_steps = tl.minimum(tl.load(num_tokens_ptr + b), num_inputs)

    qk_row = b * stride_qk_b + hk * stride_qk_h + kk
    v_row = b * stride_v_b + h * stride_v_h + vv
    g_row = b * stride_g_b + h
    for t in range(num_steps):
        k = tl.load(k_ptr + qk_row + t * stride_qk_t, mask=k_mask, other=0.0).to(ACC)
        q = tl.load(q_ptr + qk_row + t * stride_qk_t, mask=k_mask, other=0.0).to(ACC)
        v = tl.load(v_ptr + v_row + t * stride_v_t, mask=v_mask, other=0.0).to(ACC)
        g = tl.load(g_ptr + g_row + t * stride_g_t).to(ACC)
        beta = tl.load(beta_ptr + g_row + t * stride_g_t).to(ACC)
        state = gdn_state_step(state, k, v, g, beta)
        o = tl.sum(state * q[:, None], axis=0)  # S_tᵀ q_t  [BLOCK_V]
        tl.store(o_ptr + v_row + t * stride_v_t, o.to(o_ptr.dtype.element_ty), mask=v_mask)
        snap = tl.load(snap_slot_ptr + b * stride_snap_b + t)
        if snap >= 0:
            tl.store(state_ptr + snap * stride_state_slot + tile,
                     state.to(state_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _gdn_replay_kernel(
    state_ptr, src_slot_ptr, dst_slot_ptr, num_steps_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    num_inputs, d_k, d_v, heads_per_key,
    stride_state_slot, stride_state_head, stride_state_k,
    stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h,
    stride_g_b, stride_g_t,
    ACC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per (batch row, value head, block of d_v), as in _gdn_verify_kernel.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dst = tl.load(dst_slot_ptr + b)
    if dst >= 0:
        kk, vv, k_mask, v_mask, tile, tile_mask, hk = gdn_tile(
            h, heads_per_key, d_k, d_v, stride_state_head, stride_state_k, BLOCK_K, BLOCK_V)
        src = tl.load(src_slot_ptr + b)
        state = tl.load(state_ptr + src * stride_state_slot + tile, mask=tile_mask, other=0.0).to(ACC)
        num_steps = tl.minimum(tl.load(num_steps_ptr + b), num_inputs)
        k_row = b * stride_k_b + hk * stride_k_h + kk
        v_row = b * stride_v_b + h * stride_v_h + vv
        g_row = b * stride_g_b + h
        for t in range(num_steps):
            k = tl.load(k_ptr + k_row + t * stride_k_t, mask=k_mask, other=0.0).to(ACC)
            v = tl.load(v_ptr + v_row + t * stride_v_t, mask=v_mask, other=0.0).to(ACC)
            g = tl.load(g_ptr + g_row + t * stride_g_t).to(ACC)
            beta = tl.load(beta_ptr + g_row + t * stride_g_t).to(ACC)
            state = gdn_state_step(state, k, v, g, beta)
        tl.store(state_ptr + dst * stride_state_slot + tile, state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def gdn_block_sizes(d_k, d_v):
    """(BLOCK_K, BLOCK_V, num_warps): the whole d_k per program (S'ᵀ k sums over
    it) and about 1,024 state elements per program (8 columns of a 128-row
    head, fla's fused recurrent split), so that a small batch still fills the GPU."""
    block_k = triton.next_power_of_2(d_k)
    block_v = max(1, min(triton.next_power_of_2(d_v), 1024 // block_k))
    return block_k, block_v, 1 if block_k * block_v <= 1024 else 4


# -------------------------------------------------------------------- launchers


def gdn_verify(states, src_slot, snap_slot, q, k, v, g, beta, num_tokens):
    """Advance each row's state from `src_slot` over its first num_tokens
    inputs, writing snapshots into `snap_slot`; see the module docstring.

    states [num_slots, HV, d_k, d_v] (written in place)
    src_slot [batch] int64     snap_slot [batch, T] int64 (-1: none)
    q, k [batch, T, HK, d_k]   v [batch, T, HV, d_v]   g, beta [batch, T, HV]
    num_tokens [batch] int64
    Returns o [batch, T, HV, d_v] in v's dtype, before the gated norm.
    """
    if src_slot is None or snap_slot is None or num_tokens is None:
        raise ValueError("gdn_verify needs src_slot, snap_slot and num_tokens tensors (plan= is the reference's)")
    check_gdn_verify_args(states, src_slot, snap_slot, q, k, v, g, beta, num_tokens)
    check_kernel_device(states, "gdn_verify_ref")
    batch, num_inputs, heads, d_v = v.shape
    key_heads, d_k = k.shape[2:]
    o = torch.zeros_like(v)  # [batch, T, HV, d_v]; padding inputs stay zero
    block_k, block_v, num_warps = gdn_block_sizes(d_k, d_v)
    grid = (batch, heads, triton.cdiv(d_v, block_v))
    _gdn_verify_kernel[grid](
        states, src_slot, snap_slot, q, k, v, g, beta, num_tokens, o,
        num_inputs, d_k, d_v, heads // key_heads,
        states.stride(0), states.stride(1), states.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1),
        snap_slot.stride(0),
        ACC=triton_dtype(accumulate_dtype(states, q, k, v, g, beta)),
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )
    return o


def gdn_replay(states, src_slot, dst_slot, num_steps, k, v, g, beta):
    """gdn_replay_ref's log replay as one launch: states [num_slots, HV, d_k, d_v]
    (dst rows written in place); src_slot, dst_slot (-1: skip), num_steps
    [batch] int64; k [batch, T, HK, d_k], v [batch, T, HV, d_v], g, beta
    [batch, T, HV] (the input log)."""
    check_gdn_replay_args(states, src_slot, dst_slot, num_steps, k, v, g, beta)
    check_kernel_device(states, "gdn_replay_ref")
    batch, num_inputs, heads, d_v = v.shape
    key_heads, d_k = k.shape[2:]
    block_k, block_v, num_warps = gdn_block_sizes(d_k, d_v)
    grid = (batch, heads, triton.cdiv(d_v, block_v))
    _gdn_replay_kernel[grid](
        states, src_slot, dst_slot, num_steps, k, v, g, beta,
        num_inputs, d_k, d_v, heads // key_heads,
        states.stride(0), states.stride(1), states.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1),
        ACC=triton_dtype(accumulate_dtype(states, k, v, g, beta)),
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )


# ------------------------------------------------------------------- references


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
    check_gdn_verify_args(states, src_slot, snap_slot, q, k, v, g, beta, num_tokens)
    batch, num_inputs, heads = v.shape[:3]
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
    check_gdn_replay_args(states, src_slot, dst_slot, num_steps, k, v, g, beta)
    batch, num_inputs, heads = v.shape[:3]
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
