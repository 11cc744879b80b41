"""Causal depthwise conv over a few tokens from a conv-window slot, and the
rebuild of a window at any boundary from logged conv inputs.

A Mamba mixer convolves each channel c of its conv input u (xBC for Mamba-2,
x for Mamba-1) with a kernel of width d_conv:

    out_t[c] = act(bias[c] + Σ_k weight[c, k] · u_{t - (d_conv-1) + k}[c])

The window `conv_states [num_slots, conv_dim, d_conv - 1]` keeps the last
d_conv - 1 conv inputs (pre-conv, oldest first). `conv_window_update` reads
row b's window from `src_slot[b]`, consumes its first num_tokens[b] inputs
(clamped to [0, T]; out rows past it are zero) and writes the window after
input t into `snap_slot[b, t]` unless -1 (it may be the source slot, which is
read first). `conv_window_rebuild` writes into `dst_slot[b]` (-1: skip) the
window after the first num_steps[b] logged inputs: the last d_conv - 1 of
concat(src window, xs[b, :num_steps[b]]). Distinct rows must not write the
same slot, nor a slot another row reads.
"""

import torch

from hybridspec.kernels.triton.triton_import import tl, triton

from hybridspec.kernels.triton.mamba2_verify import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    accumulate_dtype,
    as_dtype,
    check_slot_tensors,
    slot_plan_for,
    check_kernel_device,
    check_ndim,
    check_tensor,
    triton_dtype,
    write_slots_ref,
)

ACTIVATIONS = (None, "silu")


def check_conv_inputs(conv_states, xs):
    """Check the window pool (it fixes conv_dim and d_conv) and the conv inputs."""
    check_ndim("conv_states", conv_states, 3, "[num_slots, conv_dim, d_conv - 1]")
    check_ndim("xs", xs, 3, "[batch, T, conv_dim]")
    conv_dim, width = conv_states.shape[1:]
    if width < 1:
        raise ValueError(f"conv_states has a window of {width} inputs; a causal conv needs d_conv >= 2")
    device = conv_states.device
    check_tensor("conv_states", conv_states, conv_states.shape, FLOAT_DTYPES, device)
    check_tensor("xs", xs, (xs.shape[0], xs.shape[1], conv_dim), FLOAT_DTYPES, device,
                 "= [batch, T, conv_dim] with conv_dim from conv_states [num_slots, conv_dim, d_conv - 1]")


def check_update_args(conv_states, src_slot, snap_slot, xs, weight, bias, num_tokens, activation):
    check_conv_inputs(conv_states, xs)
    batch, num_inputs, conv_dim = xs.shape
    device = conv_states.device
    check_ndim("weight", weight, 2, "[conv_dim, d_conv] (squeeze HF's [conv_dim, 1, d_conv])")
    width = conv_states.shape[2]
    if weight.shape[1] != width + 1:
        raise ValueError(f"weight has d_conv={weight.shape[1]} but conv_states keeps windows of "
                         f"{width} inputs (d_conv - 1); allocate the pool for this layer's d_conv")
    check_tensor("weight", weight, (conv_dim, width + 1), FLOAT_DTYPES, device)
    if bias is not None:
        check_tensor("bias", bias, (conv_dim,), FLOAT_DTYPES, device)
    check_slot_tensors(src_slot, snap_slot, num_tokens, batch, num_inputs, device)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {ACTIVATIONS}")


def check_rebuild_args(conv_states, src_slot, dst_slot, num_steps, xs):
    check_conv_inputs(conv_states, xs)
    batch = xs.shape[0]
    device = conv_states.device
    check_tensor("src_slot", src_slot, (batch,), INDEX_DTYPES, device)
    check_tensor("dst_slot", dst_slot, (batch,), INDEX_DTYPES, device)
    check_tensor("num_steps", num_steps, (batch,), INDEX_DTYPES, device)


# --------------------------------------------------------------------- kernels


@triton.jit
def shift_window_left(window, k):
    """window[:, k] <- window[:, k + 1], last column <- 0; window [BLOCK_C, BLOCK_K].
    Registers cannot be indexed by a column, so select with a one-hot mask."""
    pick = (k[:, None] + 1) == k[None, :]  # [BLOCK_K (to), BLOCK_K (from)]
    return tl.sum(tl.where(pick[None, :, :], window[:, None, :], 0.0), axis=2)


# No autotuning: the kernels write conv windows in place, and autotune's trial
# runs would consume the source window that a snapshot overwrote.
@triton.jit
def _conv_window_update_kernel(
    conv_ptr, src_slot_ptr, snap_slot_ptr, xs_ptr, weight_ptr, bias_ptr, num_tokens_ptr, out_ptr,
    num_inputs, conv_dim,
    stride_conv_slot, stride_conv_c,
    stride_xs_b, stride_xs_t,
    stride_snap_b,
    D_CONV: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program per (batch row, block of channels). Register column k holds
    # the input at window position k (d_conv - 1 = newest). Before input 0,
    # columns 1..d_conv-1 hold the source window; each input shifts it left.
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    c_mask = c < conv_dim
    # slot column k - 1 <-> register column k, for k in 1..d_conv-1
    slot_cols = c[:, None] * stride_conv_c + (k[None, :] - 1)
    slot_mask = c_mask[:, None] & ((k >= 1) & (k < D_CONV))[None, :]

    src = tl.load(src_slot_ptr + b)
    window = tl.load(conv_ptr + src * stride_conv_slot + slot_cols, mask=slot_mask, other=0.0).to(ACC)
    weight = tl.load(weight_ptr + c[:, None] * D_CONV + k[None, :],
                     mask=c_mask[:, None] & (k < D_CONV)[None, :], other=0.0).to(ACC)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(ACC)
    else:
        bias = tl.zeros([BLOCK_C], dtype=ACC)
    num_steps = tl.minimum(tl.load(num_tokens_ptr + b), num_inputs)

    xs_row = xs_ptr + b * stride_xs_b + c
    out_row = out_ptr + b * stride_xs_b + c
    for t in range(num_steps):
        u = tl.load(xs_row + t * stride_xs_t, mask=c_mask, other=0.0).to(ACC)
        window = tl.where(k[None, :] == D_CONV - 1, u[:, None], shift_window_left(window, k))
        out = bias + tl.sum(window * weight, axis=1)
        if SILU:
            out = out * tl.sigmoid(out)
        tl.store(out_row + t * stride_xs_t, out.to(out_ptr.dtype.element_ty), mask=c_mask)
        snap = tl.load(snap_slot_ptr + b * stride_snap_b + t)
        if snap >= 0:
            tl.store(conv_ptr + snap * stride_conv_slot + slot_cols,
                     window.to(conv_ptr.dtype.element_ty), mask=slot_mask)


@triton.jit
def _conv_window_rebuild_kernel(
    conv_ptr, src_slot_ptr, dst_slot_ptr, num_steps_ptr, xs_ptr,
    num_inputs, conv_dim,
    stride_conv_slot, stride_conv_c,
    stride_xs_b, stride_xs_t,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # One program per (batch row, block of channels). Window column j after n
    # inputs is element n + j of concat(src window, xs): from the source slot
    # when n + j < WIDTH, else input n + j - WIDTH.
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    dst = tl.load(dst_slot_ptr + b)
    if dst >= 0:
        src = tl.load(src_slot_ptr + b)
        num_steps = tl.maximum(tl.minimum(tl.load(num_steps_ptr + b), num_inputs), 0)
        pos = num_steps + j  # [BLOCK_W]
        col_mask = c[:, None] < conv_dim
        col_mask = col_mask & (j < WIDTH)[None, :]
        from_src = tl.load(conv_ptr + src * stride_conv_slot + c[:, None] * stride_conv_c + pos[None, :],
                           mask=col_mask & (pos < WIDTH)[None, :], other=0.0)
        from_xs = tl.load(xs_ptr + b * stride_xs_b + (pos[None, :] - WIDTH) * stride_xs_t + c[:, None],
                          mask=col_mask & (pos >= WIDTH)[None, :], other=0.0)
        window = tl.where((pos < WIDTH)[None, :], from_src, from_xs.to(conv_ptr.dtype.element_ty))
        tl.store(conv_ptr + dst * stride_conv_slot + c[:, None] * stride_conv_c + j[None, :],
                 window, mask=col_mask)


def conv_block_size(conv_dim):
    return max(16, min(triton.next_power_of_2(conv_dim), 128))


# ------------------------------------------------------------------- launchers


def conv_window_update(conv_states, src_slot, snap_slot, xs, weight, bias, num_tokens, activation):
    """Causal depthwise conv of up to T inputs per row from the window in
    `src_slot`, writing windows into `snap_slot`; see the module docstring.

    conv_states [num_slots, conv_dim, d_conv - 1] (written in place)
    src_slot [batch] int64      snap_slot [batch, T] int64 (-1: none)
    xs [batch, T, conv_dim]     weight [conv_dim, d_conv]     bias [conv_dim] or None
    num_tokens [batch] int64    activation "silu" or None
    Returns out [batch, T, conv_dim] in xs's dtype.
    """
    check_update_args(conv_states, src_slot, snap_slot, xs, weight, bias, num_tokens, activation)
    check_kernel_device(conv_states, "conv_window_update_ref")
    batch, num_inputs, conv_dim = xs.shape
    d_conv = weight.shape[1]
    out = torch.zeros_like(xs)  # [batch, T, conv_dim]
    block_c = conv_block_size(conv_dim)
    grid = (batch, triton.cdiv(conv_dim, block_c))
    _conv_window_update_kernel[grid](
        conv_states, src_slot, snap_slot, xs, weight, weight if bias is None else bias, num_tokens, out,
        num_inputs, conv_dim,
        conv_states.stride(0), conv_states.stride(1),
        xs.stride(0), xs.stride(1),
        snap_slot.stride(0),
        D_CONV=d_conv, HAS_BIAS=bias is not None, SILU=activation == "silu",
        ACC=triton_dtype(accumulate_dtype(conv_states, xs, weight, bias)),
        BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(d_conv),
    )
    return out


def conv_window_rebuild(conv_states, src_slot, dst_slot, num_steps, xs):
    """Write into `dst_slot[b]` (-1: skip) the window after the first
    num_steps[b] inputs of `xs [batch, T, conv_dim]` (the input log), starting
    from the window in `src_slot[b]`. conv_states [num_slots, conv_dim, d_conv - 1]."""
    check_rebuild_args(conv_states, src_slot, dst_slot, num_steps, xs)
    check_kernel_device(conv_states, "conv_window_rebuild_ref")
    batch, num_inputs, conv_dim = xs.shape
    width = conv_states.shape[2]
    block_c = conv_block_size(conv_dim)
    grid = (batch, triton.cdiv(conv_dim, block_c))
    _conv_window_rebuild_kernel[grid](
        conv_states, src_slot, dst_slot, num_steps, xs,
        num_inputs, conv_dim,
        conv_states.stride(0), conv_states.stride(1),
        xs.stride(0), xs.stride(1),
        WIDTH=width, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(width),
    )


# ------------------------------------------------------------------ references


def extended_inputs_ref(conv_states, src_slot, xs, acc):
    """concat(src window, xs) along time: [batch, conv_dim, d_conv - 1 + T]."""
    window = conv_states[src_slot].to(acc)  # [batch, conv_dim, d_conv - 1], a copy
    return torch.cat([window, xs.to(acc).transpose(1, 2)], dim=2)


def conv_window_update_ref(conv_states, src_slot, snap_slot, xs, weight, bias, num_tokens, activation, plan=None):
    """Plain-torch conv_window_update: same arguments, same in-place writes, same out.
    `plan`: the forward's `SlotPlan` (None: built from the slot tensors)."""
    check_update_args(conv_states, src_slot, snap_slot, xs, weight, bias, num_tokens, activation)
    plan = slot_plan_for(plan, src_slot, snap_slot, num_tokens, *xs.shape[:2])
    acc = accumulate_dtype(conv_states, xs, weight, bias)
    num_inputs, d_conv = xs.shape[1], weight.shape[1]
    window = as_dtype(plan.read(conv_states), acc)  # [batch, conv_dim, d_conv - 1]
    ext = torch.cat([window, as_dtype(xs, acc).transpose(1, 2)], dim=2)  # [batch, conv_dim, d_conv - 1 + T]
    if num_inputs == 1:  # decode: the extended window is the conv's one window
        out = (ext * as_dtype(weight, acc)).sum(-1)[:, None]  # [batch, 1, conv_dim]
        if plan.steps[0] is not None:
            plan.steps[0].write(conv_states, ext[:, :, 1:])
    else:
        windows = ext.unfold(2, d_conv, 1)  # [batch, conv_dim, T, d_conv]
        out = (windows * as_dtype(weight, acc)[:, None, :]).sum(-1).transpose(1, 2)  # [batch, T, conv_dim]
        plan.write_all(conv_states, windows[:, :, :, 1:].transpose(1, 2))
    if bias is not None:
        out = out + as_dtype(bias, acc)
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    if not plan.all_live:
        out = out.masked_fill(plan.dead_inputs, 0.0)
    return as_dtype(out, xs.dtype)


def conv_window_rebuild_ref(conv_states, src_slot, dst_slot, num_steps, xs):
    """Plain-torch conv_window_rebuild: same arguments, same in-place writes."""
    check_rebuild_args(conv_states, src_slot, dst_slot, num_steps, xs)
    width = conv_states.shape[2]
    ext = extended_inputs_ref(conv_states, src_slot, xs, conv_states.dtype)
    start = num_steps.clamp(0, xs.shape[1])  # [batch]
    cols = start[:, None] + torch.arange(width, device=xs.device)  # [batch, d_conv - 1]
    window = ext.gather(2, cols[:, None, :].expand(-1, ext.shape[1], -1))  # [batch, conv_dim, d_conv - 1]
    write_slots_ref(conv_states, dst_slot, torch.ones_like(dst_slot, dtype=torch.bool), window)
