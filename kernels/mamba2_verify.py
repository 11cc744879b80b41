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

from .triton_import import tl, triton

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


def check_kernel_device(tensor, ref_name):
    """Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU."""
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, got {tensor.device}; "
            f"call {ref_name} on CPU (or set TRITON_INTERPRET=1 before importing triton)"
        )


def accumulate_dtype(*tensors):
    """float64 if any floating input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def triton_dtype(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def write_snapshots_ref(pool, snap_slot, is_live, values):
    """pool[snap_slot[b, t]] = values[b, t] for live entries whose slot is not -1,
    in one write; when a row names a slot twice the later input wins (as in
    the kernels, which write in input order). The reference runs on the host,
    so which entries write is worked out on small Python lists.
    pool [num_slots, ...]; snap_slot, is_live [batch, T]; values [batch, T, ...]."""
    slots, live = snap_slot.tolist(), is_live.tolist()
    latest = {}  # slot -> (b, t) of the last live write to it
    for b, (row, row_live) in enumerate(zip(slots, live)):
        for t, (slot, is_row_live) in enumerate(zip(row, row_live)):
            if slot >= 0 and is_row_live:
                latest[slot] = (b, t)
    if not latest:
        return
    rows, steps = zip(*latest.values())
    index = torch.tensor(list(latest), dtype=torch.long, device=pool.device)
    pool.index_copy_(0, index, values[list(rows), list(steps)].to(pool.dtype))


def step_snapshot_plan_ref(snap_slot, num_tokens):
    """Per verify input t, the slot tensor of the live rows that snapshot after
    it and those rows (None: every row), or None when no row does. The
    references write each step's state into its slot as soon as it is computed
    (input order, so a later input wins a repeated slot)."""
    slots, counts = snap_slot.tolist(), num_tokens.tolist()
    batch = len(slots)
    plan = []
    for t in range(snap_slot.shape[1]):
        rows = [b for b in range(batch) if t < counts[b] and slots[b][t] >= 0]
        if not rows:
            plan.append(None)
        elif len(rows) == batch:
            plan.append((snap_slot[:, t], None))
        else:
            plan.append((torch.tensor([slots[b][t] for b in rows], device=snap_slot.device),
                         torch.tensor(rows, device=snap_slot.device)))
    return plan


def slot_view_ref(pool, step_plan, acc):
    """The pool slot a one-row step writes, as a [1, ...] view a step can
    compute into (None when the step has several rows, writes nothing, or the
    pool's dtype is not the accumulation dtype)."""
    if step_plan is None or pool.dtype != acc or step_plan[0].numel() != 1:
        return None
    slot = int(step_plan[0])
    return pool[slot:slot + 1]


def write_step_ref(pool, step_plan, state):
    """Write one step's state [batch, ...] into the slots `step_plan` names."""
    if step_plan is None:
        return
    slots, rows = step_plan
    pool.index_copy_(0, slots, (state if rows is None else state[rows]).to(pool.dtype))


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
    check_tensor("src_slot", src_slot, (batch,), INDEX_DTYPES, device)
    check_tensor("snap_slot", snap_slot, (batch, num_inputs), INDEX_DTYPES, device)
    check_tensor("num_tokens", num_tokens, (batch,), INDEX_DTYPES, device)


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


def mamba2_verify_ref(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens):
    """Plain-torch mamba2_verify: same arguments, same in-place writes, same y.
    Each step's state goes straight into its snapshot slot (no stack of states)."""
    check_mamba2_verify_args(ssm_states, src_slot, snap_slot, x, dt, A, B, C, D, num_tokens)
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    out_dtype = x.dtype
    x, dt, B, C = mamba2_inputs_ref(x, dt, B, C, acc)  # B, C [batch, T, nheads, d_state]
    A, D = A.to(acc), D.to(acc)
    num_inputs = x.shape[1]
    decay = torch.exp(dt * A)  # [batch, T, nheads]: exp(Δ_t A) of every step at once
    inject = (dt[..., None] * x)[..., None] * B[:, :, :, None, :]  # [batch, T, nheads, headdim, d_state]
    skip = D[:, None] * x  # [batch, T, nheads, headdim]
    state = ssm_states[src_slot].to(acc)  # [batch, nheads, headdim, d_state], a copy
    plan = step_snapshot_plan_ref(snap_slot, num_tokens)
    all_live = bool((num_tokens >= num_inputs).all())  # no padded inputs: skip the masking
    y = torch.empty_like(x)  # [batch, T, nheads, headdim]
    for t in range(num_inputs):
        into = slot_view_ref(ssm_states, plan[t], acc) if all_live else None
        if into is not None:  # one row: the step writes its snapshot slot directly
            state = torch.addcmul(inject[:, t], state, decay[:, t, :, None, None], out=into)
        else:
            stepped = inject[:, t].addcmul_(state, decay[:, t, :, None, None])  # h_t = exp(Δ A) h_{t-1} + Δ x ⊗ B
            state = stepped if all_live else torch.where((t < num_tokens)[:, None, None, None], stepped, state)
            write_step_ref(ssm_states, plan[t], state)
        torch.matmul(state, C[:, t, :, :, None], out=y[:, t, :, :, None])  # y_t = h_t C_t
    y += skip
    if not all_live:
        y.masked_fill_((torch.arange(num_inputs, device=x.device) >= num_tokens[:, None])[..., None, None], 0.0)
    return y.to(out_dtype)
