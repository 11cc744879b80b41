"""Mamba-1 (Jamba) multi-token selective-scan update from a state slot: plain
decode (T = 1) and speculative verification (T = γ + 1), writing snapshots.

Symbols (Mamba, Gu & Dao 2023, eq. 2a-2b with Ā = exp(ΔA) and B̄ = ΔB):
    x_t, Δ_t  [d_inner]       channel inputs and step sizes (Δ = softplus(...))
    A         [d_inner, d_state], negative
    B_t, C_t  [d_state]       input-dependent projections shared by all channels
    h_t       [d_inner, d_state]
    D         [d_inner]       skip connection

    h_t = exp(Δ_t ⊗ A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t        (state update)
    y_t = h_t · C_t + D ⊙ x_t                             (output, before the gate)

Slot semantics are those of `mamba2_verify`: row b starts from `src_slot[b]`,
the state after input t goes to `snap_slot[b, t]` unless -1 (it may be the
source slot, which is read first), inputs t >= num_tokens[b] are ignored and
their y rows are zero. The pool is `ssm_states [num_slots, d_inner, d_state]`.
"""

import torch

from hybridspec.kernels.triton.triton_import import tl, triton

from hybridspec.kernels.triton.mamba2_verify import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    accumulate_dtype,
    check_kernel_device,
    check_ndim,
    check_tensor,
    state_block_sizes,
    as_dtype,
    check_slot_tensors,
    slot_plan_for,
    triton_dtype,
)


FROM_POOL = " with sizes from ssm_states [num_slots, d_inner, d_state]"


def check_mamba1_inputs(ssm_states, x, dt, A, B, C):
    """Check the state pool and the per-token inputs shared by verify and replay."""
    check_ndim("ssm_states", ssm_states, 3, "[num_slots, d_inner, d_state]")
    check_ndim("x", x, 3, "[batch, T, d_inner]")
    d_inner, d_state = ssm_states.shape[1:]
    batch, num_inputs = x.shape[:2]
    device = ssm_states.device
    check_tensor("ssm_states", ssm_states, ssm_states.shape, FLOAT_DTYPES, device)
    inputs = {
        "x": (x, (batch, num_inputs, d_inner), "[batch, T, d_inner]"),
        "dt": (dt, (batch, num_inputs, d_inner), "[batch, T, d_inner]"),
        "A": (A, (d_inner, d_state), "[d_inner, d_state]"),
        "B": (B, (batch, num_inputs, d_state), "[batch, T, d_state]"),
        "C": (C, (batch, num_inputs, d_state), "[batch, T, d_state]"),
    }
    for name, (tensor, shape, layout) in inputs.items():
        check_tensor(name, tensor, shape, FLOAT_DTYPES, device, f"= {layout}{FROM_POOL}")


def check_mamba1_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens):
    check_mamba1_inputs(ssm_states, x, dt, A, B, C)
    batch, num_inputs, d_inner = x.shape
    device = ssm_states.device
    check_tensor("D", D, (d_inner,), FLOAT_DTYPES, device, f"= [d_inner]{FROM_POOL}")
    check_slot_tensors(src_slot, snap_slot, num_tokens, batch, num_inputs, device)


def mamba1_step_ref(state, x, dt, A, B):
    """One token of h_t = exp(Δ_t ⊗ A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t for every row.

    state [batch, d_inner, d_state]; x, dt [batch, d_inner];
    A [d_inner, d_state]; B [batch, d_state]. Returns the new state.
    """
    decay = torch.exp(dt[..., None] * A)  # [batch, d_inner, d_state]
    return decay * state + (dt * x)[..., None] * B[:, None, :]


# ---------------------------------------------------------------------- kernel


@triton.jit
def mamba1_state_step(state, x, dt, A, B):
    """h_t = exp(Δ_t ⊗ A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t; state, A [BLOCK_D, BLOCK_N],
    x, dt [BLOCK_D], B [BLOCK_N]."""
    return tl.exp(dt[:, None] * A) * state + (dt * x)[:, None] * B[None, :]


# No autotuning: the kernel writes state slots in place, and autotune's trial
# runs would advance them several times.
@triton.jit
def _mamba1_verify_kernel(
    state_ptr, src_slot_ptr, snap_slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
    num_tokens_ptr, y_ptr,
    num_inputs, d_inner, d_state,
    stride_state_slot, stride_state_d,
    stride_x_b, stride_x_t,
    stride_bc_b, stride_bc_t,
    stride_snap_b,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (batch row, block of channels); the state block stays in
    # registers across the T inputs. Innermost dims are contiguous.
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < d_inner
    n_mask = n < d_state
    tile_mask = d_mask[:, None] & n_mask[None, :]

    tile = d[:, None] * stride_state_d + n[None, :]
    src = tl.load(src_slot_ptr + b)
    state = tl.load(state_ptr + src * stride_state_slot + tile, mask=tile_mask, other=0.0).to(ACC)
    A = tl.load(A_ptr + d[:, None] * d_state + n[None, :], mask=tile_mask, other=0.0).to(ACC)
    D = tl.load(D_ptr + d, mask=d_mask, other=0.0).to(ACC)
    num_steps = tl.minimum(tl.load(num_tokens_ptr + b), num_inputs)

    x_row = x_ptr + b * stride_x_b + d
    y_row = y_ptr + b * stride_x_b + d
    dt_row = dt_ptr + b * stride_x_b + d
    bc_row = b * stride_bc_b + n
    for t in range(num_steps):
        x = tl.load(x_row + t * stride_x_t, mask=d_mask, other=0.0).to(ACC)
        dt = tl.load(dt_row + t * stride_x_t, mask=d_mask, other=0.0).to(ACC)
        B = tl.load(B_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        C = tl.load(C_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        state = mamba1_state_step(state, x, dt, A, B)
        y = tl.sum(state * C[None, :], axis=1) + D * x
        tl.store(y_row + t * stride_x_t, y.to(y_ptr.dtype.element_ty), mask=d_mask)
        snap = tl.load(snap_slot_ptr + b * stride_snap_b + t)
        if snap >= 0:
            tl.store(state_ptr + snap * stride_state_slot + tile,
                     state.to(state_ptr.dtype.element_ty), mask=tile_mask)


# -------------------------------------------------------------------- launcher


def mamba1_verify(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens):
    """Advance each row's state from `src_slot` over its first num_tokens inputs,
    writing snapshots into `snap_slot`; see the module docstring.

    ssm_states [num_slots, d_inner, d_state] (written in place)
    src_slot   [batch] int64          snap_slot [batch, T] int64 (-1: none)
    x, dt [batch, T, d_inner] (dt processed)    A [d_inner, d_state]
    B, C  [batch, T, d_state]         D [d_inner]     num_tokens [batch] int64
    Returns y [batch, T, d_inner] in x's dtype, before the gate.
    """
    check_mamba1_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens)
    check_kernel_device(ssm_states, "mamba1_verify_ref")
    batch, num_inputs, d_inner = x.shape
    d_state = A.shape[1]
    y = torch.zeros_like(x)  # [batch, T, d_inner]
    block_d, block_n, num_warps = state_block_sizes(d_inner, d_state)
    grid = (batch, triton.cdiv(d_inner, block_d))
    _mamba1_verify_kernel[grid](
        ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens, y,
        num_inputs, d_inner, d_state,
        ssm_states.stride(0), ssm_states.stride(1),
        x.stride(0), x.stride(1),
        B.stride(0), B.stride(1),
        snap_slot.stride(0),
        ACC=triton_dtype(accumulate_dtype(ssm_states, x, dt, A, B, C, D)),
        BLOCK_D=block_d, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y


# ------------------------------------------------------------------- reference


def mamba1_verify_ref(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens, plan=None):
    """Plain-torch mamba1_verify: same arguments, same in-place writes, same y.
    `plan`: the forward's `SlotPlan` (None: built from the slot tensors).
    Each step's state goes straight into its snapshot slots (no stack of
    states): the recurrence runs in them when they form one grid of the pool
    (`SlotPlan.snapshot_grid`), else computes into them when they form a span."""
    check_mamba1_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens)
    plan = slot_plan_for(plan, src_slot, snap_slot, num_tokens, *x.shape[:2])
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    out_dtype = x.dtype
    x, dt, A, B, C, D = (as_dtype(v, acc) for v in (x, dt, A, B, C, D))
    num_inputs = x.shape[1]
    grid = plan.grid_view(ssm_states, time_major=False) if ssm_states.dtype == acc else None
    # (Δ_t x_t) ⊗ B_t [batch, T, d_inner, d_state], written straight into the snapshot slots when they form a grid
    inject = torch.mul((dt * x)[..., None], B[:, :, None, :], **({} if grid is None else {"out": grid}))
    state = as_dtype(plan.read(ssm_states), acc)  # [batch, d_inner, d_state]
    direct = plan.all_live and ssm_states.dtype == acc
    y = torch.empty_like(x)  # [batch, T, d_inner]
    for t, writes in enumerate(plan.steps):
        decay = torch.exp(dt[:, t, :, None] * A)  # [batch, d_inner, d_state]
        slots = None if grid is not None or not direct or writes is None else writes.view(ssm_states)
        if grid is not None:  # inject[:, t] is the slots of input t: h_t computed in place
            state = inject[:, t].addcmul_(decay, state)
        elif slots is not None:  # compute into the snapshot slots (they form a span of the pool)
            state = torch.addcmul(inject[:, t], decay, state, out=slots)
        else:
            stepped = inject[:, t].addcmul_(decay, state)  # exp(Δ ⊗ A) ⊙ h + (Δ x) ⊗ B
            state = stepped if plan.all_live else torch.where(plan.is_live[:, t, None, None], stepped, state)
            if writes is not None:
                writes.write(ssm_states, state)
        y[:, t] = torch.bmm(C[:, t, None, :], state.transpose(1, 2))[:, 0]  # y_t = h_t C_t (row-vector form: faster)
    y.addcmul_(D, x)
    if not plan.all_live:
        y.masked_fill_(plan.dead_inputs, 0.0)
    return as_dtype(y, out_dtype)
