"""Log replay: advance a snapshot over logged inputs to a boundary.

The input log holds the verify forward's own per-token mixer inputs (x, dt,
B, C in the layouts of `mamba2_verify` / `mamba1_verify`). Replay runs only
the state update of those modules over the first `num_steps[b]` logged
inputs, starting from `src_slot[b]`, and writes the result into `dst_slot[b]`:

    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t      (Mamba-2; Mamba-1 with A per channel)

Rows with dst_slot == -1 are skipped; num_steps == 0 copies the state
(num_steps is clamped to [0, T]); dst may equal src. No outputs are computed:
C is part of the input log and is checked, but the state does not depend on it.
Distinct rows must not write the same slot, nor a slot another row reads.
"""

import torch

from hybridspec.kernels.triton.triton_import import tl, triton

from hybridspec.kernels.triton.mamba1_verify import check_mamba1_inputs, mamba1_state_step, mamba1_step_ref
from hybridspec.kernels.triton.mamba2_verify import (
    INDEX_DTYPES,
    accumulate_dtype,
    check_kernel_device,
    check_mamba2_inputs,
    check_tensor,
    mamba2_inputs_ref,
    mamba2_state_step,
    mamba2_step_ref,
    state_block_sizes,
    triton_dtype,
    write_slots_ref,
)


def check_replay_slots(ssm_states, src_slot, dst_slot, num_steps, batch):
    device = ssm_states.device
    check_tensor("src_slot", src_slot, (batch,), INDEX_DTYPES, device)
    check_tensor("dst_slot", dst_slot, (batch,), INDEX_DTYPES, device)
    check_tensor("num_steps", num_steps, (batch,), INDEX_DTYPES, device)


def check_mamba2_replay_args(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C):
    check_mamba2_inputs(ssm_states, x, dt, A, B, C)
    check_replay_slots(ssm_states, src_slot, dst_slot, num_steps, x.shape[0])


def check_mamba1_replay_args(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C):
    check_mamba1_inputs(ssm_states, x, dt, A, B, C)
    check_replay_slots(ssm_states, src_slot, dst_slot, num_steps, x.shape[0])


# ---------------------------------------------------------------------- mamba2


# No autotuning: the kernels write state slots in place, and autotune's trial
# runs would overwrite a destination that is also the source.
@triton.jit
def _mamba2_replay_kernel(
    state_ptr, src_slot_ptr, dst_slot_ptr, num_steps_ptr, x_ptr, dt_ptr, A_ptr, B_ptr,
    num_inputs, headdim, d_state, heads_per_group,
    stride_state_slot, stride_state_head, stride_state_p,
    stride_x_b, stride_x_t, stride_x_h,
    stride_dt_b, stride_dt_t,
    stride_bc_b, stride_bc_t, stride_bc_g,
    ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (batch row, head, block of headdim), as in mamba2_verify.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < d_state
    tile_mask = p_mask[:, None] & n_mask[None, :]
    g = h // heads_per_group

    dst = tl.load(dst_slot_ptr + b)
    if dst >= 0:
        tile = h * stride_state_head + p[:, None] * stride_state_p + n[None, :]
        src = tl.load(src_slot_ptr + b)
        state = tl.load(state_ptr + src * stride_state_slot + tile, mask=tile_mask, other=0.0).to(ACC)
        A = tl.load(A_ptr + h).to(ACC)
        num_steps = tl.minimum(tl.load(num_steps_ptr + b), num_inputs)
        x_row = x_ptr + b * stride_x_b + h * stride_x_h + p
        dt_row = dt_ptr + b * stride_dt_b + h
        bc_row = b * stride_bc_b + g * stride_bc_g + n
        for t in range(num_steps):
            x = tl.load(x_row + t * stride_x_t, mask=p_mask, other=0.0).to(ACC)
            dt = tl.load(dt_row + t * stride_dt_t).to(ACC)
            B = tl.load(B_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
            state = mamba2_state_step(state, x, dt, A, B)
        tl.store(state_ptr + dst * stride_state_slot + tile,
                 state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def mamba2_replay(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C):
    """ssm_states [num_slots, nheads, headdim, d_state] (dst rows written in place)
    src_slot, dst_slot (-1: skip), num_steps [batch] int64
    x [batch, T, nheads, headdim]; dt [batch, T, nheads]; A [nheads];
    B, C [batch, T, ngroups, d_state] (the input log)."""
    check_mamba2_replay_args(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C)
    check_kernel_device(ssm_states, "mamba2_replay_ref")
    batch, num_inputs, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2:]
    block_p, block_n, num_warps = state_block_sizes(headdim, d_state)
    grid = (batch, nheads, triton.cdiv(headdim, block_p))
    _mamba2_replay_kernel[grid](
        ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B,
        num_inputs, headdim, d_state, nheads // ngroups,
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2),
        ACC=triton_dtype(accumulate_dtype(ssm_states, x, dt, A, B)),
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps,
    )


def mamba2_replay_ref(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C):
    """Plain-torch mamba2_replay: same arguments, same in-place writes."""
    check_mamba2_replay_args(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C)
    acc = accumulate_dtype(ssm_states, x, dt, A, B)
    x, dt, B, _ = mamba2_inputs_ref(x, dt, B, C, acc)  # B [batch, T, nheads, d_state]
    A = A.to(acc)
    state = ssm_states[src_slot].to(acc)  # [batch, nheads, headdim, d_state]
    for t in range(x.shape[1]):
        is_live = t < num_steps  # [batch]
        stepped = mamba2_step_ref(state, x[:, t], dt[:, t], A, B[:, t])
        state = torch.where(is_live[:, None, None, None], stepped, state)
    write_slots_ref(ssm_states, dst_slot, torch.ones_like(dst_slot, dtype=torch.bool), state)


# ---------------------------------------------------------------------- mamba1


@triton.jit
def _mamba1_replay_kernel(
    state_ptr, src_slot_ptr, dst_slot_ptr, num_steps_ptr, x_ptr, dt_ptr, A_ptr, B_ptr,
    num_inputs, d_inner, d_state,
    stride_state_slot, stride_state_d,
    stride_x_b, stride_x_t,
    stride_bc_b, stride_bc_t,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (batch row, block of channels), as in mamba1_verify.
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < d_inner
    n_mask = n < d_state
    tile_mask = d_mask[:, None] & n_mask[None, :]

    dst = tl.load(dst_slot_ptr + b)
    if dst >= 0:
        tile = d[:, None] * stride_state_d + n[None, :]
        src = tl.load(src_slot_ptr + b)
        state = tl.load(state_ptr + src * stride_state_slot + tile, mask=tile_mask, other=0.0).to(ACC)
        A = tl.load(A_ptr + d[:, None] * d_state + n[None, :], mask=tile_mask, other=0.0).to(ACC)
        num_steps = tl.minimum(tl.load(num_steps_ptr + b), num_inputs)
        x_row = x_ptr + b * stride_x_b + d
        dt_row = dt_ptr + b * stride_x_b + d
        bc_row = b * stride_bc_b + n
        for t in range(num_steps):
            x = tl.load(x_row + t * stride_x_t, mask=d_mask, other=0.0).to(ACC)
            dt = tl.load(dt_row + t * stride_x_t, mask=d_mask, other=0.0).to(ACC)
            B = tl.load(B_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
            state = mamba1_state_step(state, x, dt, A, B)
        tl.store(state_ptr + dst * stride_state_slot + tile,
                 state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def mamba1_replay(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C):
    """ssm_states [num_slots, d_inner, d_state] (dst rows written in place)
    src_slot, dst_slot (-1: skip), num_steps [batch] int64
    x, dt [batch, T, d_inner]; A [d_inner, d_state]; B, C [batch, T, d_state]."""
    check_mamba1_replay_args(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C)
    check_kernel_device(ssm_states, "mamba1_replay_ref")
    batch, num_inputs, d_inner = x.shape
    d_state = A.shape[1]
    block_d, block_n, num_warps = state_block_sizes(d_inner, d_state)
    grid = (batch, triton.cdiv(d_inner, block_d))
    _mamba1_replay_kernel[grid](
        ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B,
        num_inputs, d_inner, d_state,
        ssm_states.stride(0), ssm_states.stride(1),
        x.stride(0), x.stride(1),
        B.stride(0), B.stride(1),
        ACC=triton_dtype(accumulate_dtype(ssm_states, x, dt, A, B)),
        BLOCK_D=block_d, BLOCK_N=block_n, num_warps=num_warps,
    )


def mamba1_replay_ref(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C):
    """Plain-torch mamba1_replay: same arguments, same in-place writes."""
    check_mamba1_replay_args(ssm_states, src_slot, dst_slot, num_steps, x, dt, A, B, C)
    acc = accumulate_dtype(ssm_states, x, dt, A, B)
    x, dt, A, B = (v.to(acc) for v in (x, dt, A, B))
    state = ssm_states[src_slot].to(acc)  # [batch, d_inner, d_state]
    for t in range(x.shape[1]):
        is_live = t < num_steps  # [batch]
        stepped = mamba1_step_ref(state, x[:, t], dt[:, t], A, B[:, t])
        state = torch.where(is_live[:, None, None], stepped, state)
    write_slots_ref(ssm_states, dst_slot, torch.ones_like(dst_slot, dtype=torch.bool), state)
