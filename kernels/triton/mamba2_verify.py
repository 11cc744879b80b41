"""Mamba-2 multi-token state update from a state slot: plain decode (T = 1)
and speculative verification (T = γ + 1), writing snapshots into slots.

Symbols (Mamba-2, Dao & Gu 2024, the SSD recurrence with a scalar A per head):
    x_t  [headdim]            the head's input at token t
    Δ_t  (dt)                 step size, already softplus(dt + dt_bias), clamped
    A    scalar < 0           per-head decay rate (= -exp(A_log))
    B_t, C_t  [d_state]       input / output projections of the head's group
    h_t  [headdim, d_state]   the SSM state after token t
    D    scalar               skip connection

    h_t = exp(Δ_t · A) · h_{t-1} + Δ_t · x_t ⊗ B_t        (state update)
    y_t = h_t · C_t + D · x_t                             (output, before the gate)

Slots index a per-layer state pool `ssm_states [num_slots, nheads, headdim,
d_state]`. Row b starts from `src_slot[b]`; the state after input t goes to
`snap_slot[b, t]` unless that is -1. A snapshot slot may equal the source
slot (plain decode updates the head in place): the source is read before any
write. Distinct rows must not write the same slot, nor a slot another row
reads. Slot indices must lie in [0, num_slots) (or be -1 where allowed);
the launchers do not check them, as that would synchronise with the GPU.
Inputs t >= num_tokens[b] are ignored (num_tokens is clamped to [0, T]);
their y rows are zero.

This module also holds the argument checks and the slot-writing helper that
the other state-slot kernels (Mamba-1, replay, conv window) share.
"""

import os

import torch

from hybridspec.kernels.slot_plan import SlotPlan
from hybridspec.kernels.triton.triton_import import tl, triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64,)


# ---------------------------------------------------------------- shared checks


def check_tensor(name, tensor, shape, dtypes, device, layout=""):
    """Raise ValueError naming `name` unless `tensor` has this exact shape, one
    of `dtypes`, lives on `device` and is contiguous. `layout` explains the
    expected shape in the error."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} {layout}".rstrip())
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}; cast it to one of {names}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but ssm/conv states are on {device}; move it")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")


def check_ndim(name, tensor, ndim, layout):
    """Raise ValueError unless `tensor` is a tensor with `ndim` dimensions."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be {ndim}-d {layout}, got {got}")


def check_slot_tensors(src_slot, snap_slot, num_tokens, batch, num_inputs, device):
    """src_slot [batch], snap_slot [batch, T], num_tokens [batch], all int64; a
    torch reference given its forward's `SlotPlan` may get None for all three."""
    if src_slot is None and snap_slot is None and num_tokens is None:
        return
    check_tensor("src_slot", src_slot, (batch,), INDEX_DTYPES, device)
    check_tensor("snap_slot", snap_slot, (batch, num_inputs), INDEX_DTYPES, device)
    check_tensor("num_tokens", num_tokens, (batch,), INDEX_DTYPES, device)


def slot_plan_for(plan, src_slot, snap_slot, num_tokens, batch, num_inputs):
    """The reference's SlotPlan: the one given (checked against the batch) or
    one read from the slot tensors."""
    if plan is None:
        if src_slot is None:
            raise ValueError("pass src_slot, snap_slot and num_tokens (or the forward's SlotPlan as plan=)")
        return SlotPlan.of_tensors(src_slot, snap_slot, num_tokens)
    if (plan.batch, plan.num_inputs) != (batch, num_inputs):
        raise ValueError(f"plan is for a batch of {plan.batch} rows of {plan.num_inputs} inputs, "
                         f"the inputs are {batch} rows of {num_inputs}; build the SlotPlan for this forward")
    return plan


def check_kernel_device(tensor, ref_name):
    """Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU."""
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, got {tensor.device}; "
            f"call {ref_name} on CPU (or set TRITON_INTERPRET=1 before importing triton)"
        )


def as_dtype(tensor, dtype):
    """`tensor` in `dtype`, without an operation when it already is (`.to` is
    an operation even then)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def accumulate_dtype(*tensors):
    """float64 if any floating input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def triton_dtype(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def write_slots_ref(pool, slots, is_live, values):
    """pool[slots[b]] = values[b] for live rows whose slot is not -1.
    pool [num_slots, ...]; slots, is_live [batch]; values [batch, ...]."""
    keep = is_live & (slots >= 0)
    pool[slots[keep]] = values[keep].to(pool.dtype)


# ------------------------------------------------------------ mamba2 arguments


FROM_POOL = " with sizes from ssm_states [num_slots, nheads, headdim, d_state]"


def check_mamba2_inputs(ssm_states, x, dt, A, B, C):
    """Check the state pool and the per-token inputs shared by verify and replay."""
    check_ndim("ssm_states", ssm_states, 4, "[num_slots, nheads, headdim, d_state]")
    check_ndim("x", x, 4, "[batch, T, nheads, headdim]")
    check_ndim("B", B, 4, "[batch, T, ngroups, d_state]")
    nheads, headdim, d_state = ssm_states.shape[1:]
    batch, num_inputs = x.shape[:2]
    ngroups = B.shape[2]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"B has {ngroups} groups, which must divide the nheads={nheads} of ssm_states")
    device = ssm_states.device
    check_tensor("ssm_states", ssm_states, ssm_states.shape, FLOAT_DTYPES, device)
    inputs = {
        "x": (x, (batch, num_inputs, nheads, headdim), "[batch, T, nheads, headdim]"),
        "dt": (dt, (batch, num_inputs, nheads), "[batch, T, nheads]"),
        "A": (A, (nheads,), "[nheads]"),
        "B": (B, (batch, num_inputs, ngroups, d_state), "[batch, T, ngroups, d_state]"),
        "C": (C, (batch, num_inputs, ngroups, d_state), "[batch, T, ngroups, d_state]"),
    }
    for name, (tensor, shape, layout) in inputs.items():
        check_tensor(name, tensor, shape, FLOAT_DTYPES, device, f"= {layout}{FROM_POOL}")


def check_mamba2_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens):
    check_mamba2_inputs(ssm_states, x, dt, A, B, C)
    batch, num_inputs, nheads = x.shape[:3]
    device = ssm_states.device
    check_tensor("D", D, (nheads,), FLOAT_DTYPES, device, f"= [nheads]{FROM_POOL}")
    check_slot_tensors(src_slot, snap_slot, num_tokens, batch, num_inputs, device)


def mamba2_step_ref(state, x, dt, A, B):
    """One token of h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t for every row and head.

    state [batch, nheads, headdim, d_state]; x [batch, nheads, headdim];
    dt [batch, nheads]; A [nheads]; B [batch, nheads, d_state] (per head).
    Returns the new state [batch, nheads, headdim, d_state].
    """
    decay = torch.exp(dt * A)  # [batch, nheads]
    inject = (dt[..., None] * x)[..., None] * B[:, :, None, :]  # [batch, nheads, headdim, d_state]
    return inject.addcmul_(state, decay[..., None, None])  # one new tensor per step


def mamba2_inputs_ref(x, dt, B, C, acc):
    """Cast the inputs to `acc` and expand B, C from groups to heads:
    [batch, T, ngroups, d_state] -> [batch, T, nheads, d_state]."""
    heads_per_group = x.shape[2] // B.shape[2]
    if heads_per_group > 1:
        B, C = (t.repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    return x.to(acc), dt.to(acc), B.to(acc), C.to(acc)


# ---------------------------------------------------------------------- kernel


@triton.jit
def mamba2_state_step(state, x, dt, A, B):
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t; state [BLOCK_P, BLOCK_N],
    x [BLOCK_P], B [BLOCK_N], dt and A scalars."""
    return state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]


# No autotuning: the kernel writes state slots in place, and autotune's trial
# runs would advance them several times.
@triton.jit
def _mamba2_verify_kernel(
    state_ptr, src_slot_ptr, snap_slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
    num_tokens_ptr, y_ptr,
    num_inputs, headdim, d_state, heads_per_group,
    stride_state_slot, stride_state_head, stride_state_p,
    stride_x_b, stride_x_t, stride_x_h,
    stride_dt_b, stride_dt_t,
    stride_bc_b, stride_bc_t, stride_bc_g,
    stride_snap_b,
    ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (batch row, head, block of headdim); the state block stays
    # in registers across the T inputs. Innermost dims are contiguous.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < d_state
    tile_mask = p_mask[:, None] & n_mask[None, :]
    g = h // heads_per_group

    tile = h * stride_state_head + p[:, None] * stride_state_p + n[None, :]
    src = tl.load(src_slot_ptr + b)
    state = tl.load(state_ptr + src * stride_state_slot + tile, mask=tile_mask, other=0.0).to(ACC)
    A = tl.load(A_ptr + h).to(ACC)
    D = tl.load(D_ptr + h).to(ACC)
    num_steps = tl.minimum(tl.load(num_tokens_ptr + b), num_inputs)

    x_row = x_ptr + b * stride_x_b + h * stride_x_h + p
    y_row = y_ptr + b * stride_x_b + h * stride_x_h + p
    dt_row = dt_ptr + b * stride_dt_b + h
    bc_row = b * stride_bc_b + g * stride_bc_g + n
    for t in range(num_steps):
        x = tl.load(x_row + t * stride_x_t, mask=p_mask, other=0.0).to(ACC)
        dt = tl.load(dt_row + t * stride_dt_t).to(ACC)
        B = tl.load(B_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        C = tl.load(C_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        state = mamba2_state_step(state, x, dt, A, B)
        y = tl.sum(state * C[None, :], axis=1) + D * x
        tl.store(y_row + t * stride_x_t, y.to(y_ptr.dtype.element_ty), mask=p_mask)
        snap = tl.load(snap_slot_ptr + b * stride_snap_b + t)
        if snap >= 0:
            tl.store(state_ptr + snap * stride_state_slot + tile,
                     state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def state_block_sizes(rows, d_state):
    """(BLOCK_rows, BLOCK_N, num_warps): the whole d_state per program and about
    512 state elements per program (the split mamba_ssm's selective_state_update
    uses), so that a small batch still fills the GPU."""
    block_n = triton.next_power_of_2(d_state)
    block_rows = max(1, min(triton.next_power_of_2(rows), 512 // block_n))
    return block_rows, block_n, 4 if block_n <= 128 else 8


# -------------------------------------------------------------------- launcher


def mamba2_verify(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens):
    """Advance each row's state from `src_slot` over its first num_tokens inputs,
    writing snapshots into `snap_slot`; see the module docstring.

    ssm_states [num_slots, nheads, headdim, d_state] (written in place)
    src_slot   [batch] int64          snap_slot [batch, T] int64 (-1: none)
    x  [batch, T, nheads, headdim]    dt [batch, T, nheads] (processed)
    A  [nheads]    B, C [batch, T, ngroups, d_state]    D [nheads]
    num_tokens [batch] int64
    Returns y [batch, T, nheads, headdim] in x's dtype, before the gate.
    """
    check_mamba2_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens)
    check_kernel_device(ssm_states, "mamba2_verify_ref")
    batch, num_inputs, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2:]
    y = torch.zeros_like(x)  # [batch, T, nheads, headdim]
    block_p, block_n, num_warps = state_block_sizes(headdim, d_state)
    grid = (batch, nheads, triton.cdiv(headdim, block_p))
    _mamba2_verify_kernel[grid](
        ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens, y,
        num_inputs, headdim, d_state, nheads // ngroups,
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2),
        snap_slot.stride(0),
        ACC=triton_dtype(accumulate_dtype(ssm_states, x, dt, A, B, C, D)),
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y


# ------------------------------------------------------------------- reference


def mamba2_verify_ref(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens, plan=None):
    """Plain-torch mamba2_verify: same arguments, same in-place writes, same y.
    `plan`: the forward's `SlotPlan` (None: built from the slot tensors).

    When every row snapshots every input into slots that form one grid of the
    pool (`SlotPlan.snapshot_grid`: aligned ring halves), the Δ x ⊗ B terms
    are written into those slots and each step updates them in place: the
    recurrence runs in the ring. Otherwise each step's states go straight into
    their snapshot slots when those form a span of the pool (`StepWrites.span`:
    one row, or rows whose rings are consecutive with the heads at one ring
    offset), else one `index_copy_` per step; no stack of states is formed.
    Heads of a group share B and C by broadcasting, never by copying them per
    head."""
    check_mamba2_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens)
    batch, num_inputs, nheads, headdim = x.shape
    plan = slot_plan_for(plan, src_slot, snap_slot, num_tokens, batch, num_inputs)
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    out_dtype = x.dtype
    ngroups, d_state = B.shape[2:]
    heads_per_group = nheads // ngroups
    x, dt, A, B, C, D = (as_dtype(v, acc) for v in (x, dt, A, B, C, D))
    if num_inputs == 1 and plan.all_live:
        return as_dtype(_decode_step_ref(ssm_states, plan, x, dt, A, B, C, D), out_dtype)
    decay = torch.exp(dt * A).transpose(0, 1).reshape(num_inputs, batch, nheads, 1, 1)  # exp(Δ_t A), time-major
    grid = plan.grid_view(ssm_states, time_major=True) if ssm_states.dtype == acc else None
    in_ring = grid is not None and groups_view_ok(grid[0], ngroups)  # the recurrence runs in the snapshot slots
    shape = (num_inputs, batch, ngroups, heads_per_group, headdim, d_state)
    inject = grid.view(shape) if in_ring else torch.empty(shape, dtype=acc, device=x.device)
    torch.mul((dt[..., None] * x).view(batch, num_inputs, ngroups, heads_per_group, headdim, 1).transpose(0, 1),
              B.view(batch, num_inputs, ngroups, 1, 1, d_state).transpose(0, 1), out=inject)  # Δ_t x_t ⊗ B_t
    inject = inject.view(num_inputs, batch, nheads, headdim, d_state)  # time-major: each step's slab is contiguous
    C_steps = C.transpose(0, 1).reshape(num_inputs, batch * ngroups, 1, d_state)  # a view for T = 1
    y = torch.empty(num_inputs, batch * ngroups, 1, heads_per_group * headdim, dtype=acc, device=x.device)
    state = as_dtype(plan.read(ssm_states), acc)  # [batch, nheads, headdim, d_state]
    direct = plan.all_live and ssm_states.dtype == acc
    for t, writes in enumerate(plan.steps):
        slots = None if in_ring or not direct or writes is None else writes.view(ssm_states)
        if in_ring:  # inject[t] is the slots of input t: h_t computed in place, nothing to write
            state = inject[t].addcmul_(state, decay[t])
        elif slots is not None and groups_view_ok(slots, ngroups):  # compute into the snapshot slots
            state = torch.addcmul(inject[t], state, decay[t], out=slots)
        else:
            stepped = inject[t].addcmul_(state, decay[t])  # h_t = exp(Δ A) h_{t-1} + Δ x ⊗ B
            state = stepped if plan.all_live else torch.where(plan.is_live[:, t, None, None, None], stepped, state)
            if writes is not None:
                writes.write(ssm_states, state)
        # y_t = h_t C_t as C_tᵀ h_tᵀ: the row-vector form of this batched product is faster on CPU than
        # the column form for more than one row
        torch.bmm(C_steps[t], state.view(batch * ngroups, heads_per_group * headdim, d_state).transpose(1, 2),
                  out=y[t])
    y = y.view(num_inputs, batch, nheads, headdim).transpose(0, 1)  # [batch, T, nheads, headdim]
    y = torch.addcmul(y, x, D.view(nheads, 1))  # + D x
    if not plan.all_live:
        y.masked_fill_(plan.dead_inputs[..., None], 0.0)
    return as_dtype(y, out_dtype)


def groups_view_ok(states, ngroups):
    """Whether `states` [batch, nheads, headdim, d_state] (slots of a pool) can be
    viewed as [batch * ngroups, heads_per_group * headdim, d_state] for the
    y product: always for one group, else only for consecutive slots."""
    return ngroups == 1 or states.is_contiguous()


def _decode_step_ref(ssm_states, plan, x, dt, A, B, C, D):
    """mamba2_verify_ref for one input per row (plain decode and drafting):
    h = exp(ΔA)·h + Δx ⊗ B, computed straight into the rows' slots when they
    form a span of the pool (one row, or aligned rings), else in a new tensor
    then written; no inject buffer."""
    batch, _, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2:]
    heads_per_group = nheads // ngroups
    writes = plan.steps[0]
    decay = torch.exp(dt * A).view(batch, nheads, 1, 1)
    state = plan.read(ssm_states)  # [batch, nheads, headdim, d_state]; a view when the sources form a span
    slots = writes.view(ssm_states) if writes is not None and ssm_states.dtype == x.dtype else None
    direct = slots is not None and groups_view_ok(slots, ngroups)
    if direct:
        new = torch.mul(state, decay, out=slots)
    else:
        new = torch.mul(as_dtype(state, x.dtype), decay)
    new.view(batch, ngroups, heads_per_group, headdim, d_state).addcmul_(
        (dt[..., None] * x).view(batch, ngroups, heads_per_group, headdim, 1),
        B.view(batch, ngroups, 1, 1, d_state))
    if writes is not None and not direct:
        writes.write(ssm_states, new)
    y = torch.bmm(C.view(batch * ngroups, 1, d_state),  # y = C h (row-vector form, as in the loop)
                  new.view(batch * ngroups, heads_per_group * headdim, d_state).transpose(1, 2))
    return torch.addcmul(y.view(batch, 1, nheads, headdim), x, D.view(nheads, 1))  # + D x
