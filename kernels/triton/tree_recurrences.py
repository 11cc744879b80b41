"""Triton kernels of the conv window and the Mamba-2, Mamba-1 and gated
DeltaNet recurrences over a tree of inputs: each input stepped from its
parent's state (the head slot's for a parent of -1), every input's state
kept. The torch forms with the same signatures are the references
(`tree_verify.conv_window_tree_ref`, `mamba2_tree_ref`, `mamba1_tree_ref`,
`gdn_tree_ref`); the per-step math is the chain kernels' own
(`mamba2_state_step`, `mamba1_state_step`, `gdn_state_step`, the conv
window's shift), so a tree whose parents form a chain computes what the chain
kernel does.

Each program walks its row's inputs in order (parents precede children)
with the state tile in registers: input t continues from the registers when
its parent is input t - 1, else reads its parent's state back from the output
buffer `states [batch, T, ...]` (in the accumulation dtype, so exactly) or
the head slot. No pool slot is written. Arguments: the pool, the forward's
`SlotPlan` (its `src` tensor: each row's head slot), the `TreePlan` (its
`parent_index [batch, T]` and `num_tokens [batch]`), then the chain kernel's
per-input tensors; each returns (outputs [batch, T, ...] in the inputs'
dtype, zero on padding; states [batch, T, ...] in the accumulation dtype,
zero on padding).
"""
from __future__ import annotations

import torch

from hybridspec.kernels.triton.conv_window import check_update_args, conv_block_size, shift_window_left
from hybridspec.kernels.triton.gdn_verify import check_gdn_verify_args, gdn_block_sizes, gdn_state_step, gdn_tile
from hybridspec.kernels.triton.mamba1_verify import check_mamba1_verify_args, mamba1_state_step
from hybridspec.kernels.triton.mamba2_verify import (INDEX_DTYPES, accumulate_dtype, check_kernel_device,
                                                     check_mamba2_verify_args, check_tensor, mamba2_state_step,
                                                     state_block_sizes, triton_dtype)
from hybridspec.kernels.triton.triton_import import tl, triton


def check_tree_args(pool, slots, tree, batch, num_inputs, ref_name):
    """The head slots and the tree's indices for `batch` rows of `num_inputs`, on the pool's device."""
    check_kernel_device(pool, ref_name)
    if (tree.batch, tree.num_inputs) != (batch, num_inputs):
        raise ValueError(f"tree is for {tree.batch} rows of {tree.num_inputs} inputs, the inputs are {batch} "
                         f"rows of {num_inputs}; build the TreePlan for this forward")
    check_tensor("slots.src", slots.src, (batch,), INDEX_DTYPES, pool.device)
    check_tensor("tree.parent_index", tree.parent_index, (batch, num_inputs), INDEX_DTYPES, pool.device)
    check_tensor("tree.num_tokens", tree.num_tokens, (batch,), INDEX_DTYPES, pool.device)


def states_buffer(pool, batch, num_inputs, acc):
    """Every input's state [batch, T, *pool.shape[1:]] in the accumulation dtype, zero on padding."""
    return torch.zeros(batch, num_inputs, *pool.shape[1:], dtype=acc, device=pool.device)


@triton.jit
def parent_state(state, parent, t, head_ptrs, states_ptrs, stride_states_t, mask, ACC: tl.constexpr):
    """The state input t steps from: `state` (input t - 1's, in registers) when
    that is its parent, else the head slot's (parent -1) or its parent's, read back."""
    if parent != t - 1:
        tl.debug_barrier()  # the parent's state was stored by every thread of this program
        if parent < 0:
            state = tl.load(head_ptrs, mask=mask, other=0.0).to(ACC)
        else:
            state = tl.load(states_ptrs + parent * stride_states_t, mask=mask, other=0.0).to(ACC)
    return state


# The kernels address a state tile in the pool and in the buffer by the same offsets (`tile`, `slot_cols`):
# both are contiguous with the same trailing shape. Block sizes are the chain kernels'.
@triton.jit
def _conv_window_tree_kernel(
    conv_ptr, src_slot_ptr, parent_ptr, num_tokens_ptr, xs_ptr, weight_ptr, bias_ptr, out_ptr, windows_ptr,
    num_inputs, conv_dim,
    stride_conv_slot, stride_conv_c, stride_win_b, stride_win_t, stride_xs_b, stride_xs_t,
    D_CONV: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program per (batch row, block of channels); register column k holds window position k
    # (d_conv - 1 = newest), columns 1..d_conv-1 the stored window, as in _conv_window_update_kernel.
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    c_mask = c < conv_dim
    slot_cols = c[:, None] * stride_conv_c + (k[None, :] - 1)  # the pool's and the buffer's inner layout
    slot_mask = c_mask[:, None] & ((k >= 1) & (k < D_CONV))[None, :]
    head = conv_ptr + tl.load(src_slot_ptr + b) * stride_conv_slot + slot_cols
    window = tl.load(head, mask=slot_mask, other=0.0).to(ACC)
    weight = tl.load(weight_ptr + c[:, None] * D_CONV + k[None, :],
                     mask=c_mask[:, None] & (k < D_CONV)[None, :], other=0.0).to(ACC)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(ACC)
    else:
        bias = tl.zeros([BLOCK_C], dtype=ACC)
    windows_row = windows_ptr + b * stride_win_b + slot_cols
    for t in range(tl.load(num_tokens_ptr + b)):
        parent = tl.load(parent_ptr + b * num_inputs + t)
        window = parent_state(window, parent, t, head, windows_row, stride_win_t, slot_mask, ACC)
        u = tl.load(xs_ptr + b * stride_xs_b + t * stride_xs_t + c, mask=c_mask, other=0.0).to(ACC)
        window = tl.where(k[None, :] == D_CONV - 1, u[:, None], shift_window_left(window, k))
        out = bias + tl.sum(window * weight, axis=1)
        if SILU:
            out = out * tl.sigmoid(out)
        tl.store(out_ptr + b * stride_xs_b + t * stride_xs_t + c, out.to(out_ptr.dtype.element_ty), mask=c_mask)
        tl.store(windows_row + t * stride_win_t, window, mask=slot_mask)


@triton.jit
def _mamba2_tree_kernel(
    pool_ptr, src_slot_ptr, parent_ptr, num_tokens_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, states_ptr,
    num_inputs, headdim, d_state, heads_per_group,
    stride_pool_slot, stride_state_head, stride_state_p, stride_states_b, stride_states_t,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_bc_b, stride_bc_t, stride_bc_g,
    ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (batch row, head, block of headdim), as in _mamba2_verify_kernel.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < d_state
    tile_mask = p_mask[:, None] & n_mask[None, :]
    tile = h * stride_state_head + p[:, None] * stride_state_p + n[None, :]
    head = pool_ptr + tl.load(src_slot_ptr + b) * stride_pool_slot + tile
    state = tl.load(head, mask=tile_mask, other=0.0).to(ACC)
    A = tl.load(A_ptr + h).to(ACC)
    D = tl.load(D_ptr + h).to(ACC)
    states_row = states_ptr + b * stride_states_b + tile
    x_row = b * stride_x_b + h * stride_x_h + p
    bc_row = b * stride_bc_b + (h // heads_per_group) * stride_bc_g + n
    for t in range(tl.load(num_tokens_ptr + b)):
        parent = tl.load(parent_ptr + b * num_inputs + t)
        state = parent_state(state, parent, t, head, states_row, stride_states_t, tile_mask, ACC)
        x = tl.load(x_ptr + x_row + t * stride_x_t, mask=p_mask, other=0.0).to(ACC)
        dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + h).to(ACC)
        B = tl.load(B_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        C = tl.load(C_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        state = mamba2_state_step(state, x, dt, A, B)
        y = tl.sum(state * C[None, :], axis=1) + D * x
        tl.store(y_ptr + x_row + t * stride_x_t, y.to(y_ptr.dtype.element_ty), mask=p_mask)
        tl.store(states_row + t * stride_states_t, state, mask=tile_mask)


@triton.jit
def _mamba1_tree_kernel(
    pool_ptr, src_slot_ptr, parent_ptr, num_tokens_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, states_ptr,
    num_inputs, d_inner, d_state,
    stride_pool_slot, stride_state_d, stride_states_b, stride_states_t,
    stride_x_b, stride_x_t, stride_bc_b, stride_bc_t,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (batch row, block of channels), as in _mamba1_verify_kernel.
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < d_inner
    n_mask = n < d_state
    tile_mask = d_mask[:, None] & n_mask[None, :]
    tile = d[:, None] * stride_state_d + n[None, :]
    head = pool_ptr + tl.load(src_slot_ptr + b) * stride_pool_slot + tile
    state = tl.load(head, mask=tile_mask, other=0.0).to(ACC)
    A = tl.load(A_ptr + d[:, None] * d_state + n[None, :], mask=tile_mask, other=0.0).to(ACC)
    D = tl.load(D_ptr + d, mask=d_mask, other=0.0).to(ACC)
    states_row = states_ptr + b * stride_states_b + tile
    x_row = b * stride_x_b + d
    bc_row = b * stride_bc_b + n
    for t in range(tl.load(num_tokens_ptr + b)):
        parent = tl.load(parent_ptr + b * num_inputs + t)
        state = parent_state(state, parent, t, head, states_row, stride_states_t, tile_mask, ACC)
        x = tl.load(x_ptr + x_row + t * stride_x_t, mask=d_mask, other=0.0).to(ACC)
        dt = tl.load(dt_ptr + x_row + t * stride_x_t, mask=d_mask, other=0.0).to(ACC)
        B = tl.load(B_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        C = tl.load(C_ptr + bc_row + t * stride_bc_t, mask=n_mask, other=0.0).to(ACC)
        state = mamba1_state_step(state, x, dt, A, B)
        y = tl.sum(state * C[None, :], axis=1) + D * x
        tl.store(y_ptr + x_row + t * stride_x_t, y.to(y_ptr.dtype.element_ty), mask=d_mask)
        tl.store(states_row + t * stride_states_t, state, mask=tile_mask)


@triton.jit
def _gdn_tree_kernel(
    pool_ptr, src_slot_ptr, parent_ptr, num_tokens_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, states_ptr,
    num_inputs, d_k, d_v, heads_per_key,
    stride_pool_slot, stride_state_head, stride_state_k, stride_states_b, stride_states_t,
    stride_qk_b, stride_qk_t, stride_qk_h, stride_v_b, stride_v_t, stride_v_h, stride_g_b, stride_g_t,
    ACC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per (batch row, value head, block of d_v), as in _gdn_verify_kernel.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk, vv, k_mask, v_mask, tile, tile_mask, hk = gdn_tile(
        h, heads_per_key, d_k, d_v, stride_state_head, stride_state_k, BLOCK_K, BLOCK_V)
    head = pool_ptr + tl.load(src_slot_ptr + b) * stride_pool_slot + tile
    state = tl.load(head, mask=tile_mask, other=0.0).to(ACC)
    states_row = states_ptr + b * stride_states_b + tile
    qk_row = b * stride_qk_b + hk * stride_qk_h + kk
    v_row = b * stride_v_b + h * stride_v_h + vv
    g_row = b * stride_g_b + h
    for t in range(tl.load(num_tokens_ptr + b)):
        parent = tl.load(parent_ptr + b * num_inputs + t)
        state = parent_state(state, parent, t, head, states_row, stride_states_t, tile_mask, ACC)
        k = tl.load(k_ptr + qk_row + t * stride_qk_t, mask=k_mask, other=0.0).to(ACC)
        q = tl.load(q_ptr + qk_row + t * stride_qk_t, mask=k_mask, other=0.0).to(ACC)
        v = tl.load(v_ptr + v_row + t * stride_v_t, mask=v_mask, other=0.0).to(ACC)
        g = tl.load(g_ptr + g_row + t * stride_g_t).to(ACC)
        beta = tl.load(beta_ptr + g_row + t * stride_g_t).to(ACC)
        state = gdn_state_step(state, k, v, g, beta)
        o = tl.sum(state * q[:, None], axis=0)  # S_tᵀ q_t  [BLOCK_V]
        tl.store(o_ptr + v_row + t * stride_v_t, o.to(o_ptr.dtype.element_ty), mask=v_mask)
        tl.store(states_row + t * stride_states_t, state, mask=tile_mask)


# ------------------------------------------------------------------- launchers


def conv_window_tree(conv_states, slots, tree, xs, weight, bias, activation):
    """conv_states [slots, conv_dim, d_conv - 1]; xs [batch, T, conv_dim]; weight [conv_dim, d_conv]
    -> (out [batch, T, conv_dim], windows [batch, T, conv_dim, d_conv - 1])."""
    check_update_args(conv_states, None, None, xs, weight, bias, None, activation)
    batch, num_inputs, conv_dim = xs.shape
    check_tree_args(conv_states, slots, tree, batch, num_inputs, "conv_window_tree_ref")
    acc = accumulate_dtype(conv_states, xs, weight, bias)
    out, windows = torch.zeros_like(xs), states_buffer(conv_states, batch, num_inputs, acc)
    block_c = conv_block_size(conv_dim)
    _conv_window_tree_kernel[(batch, triton.cdiv(conv_dim, block_c))](
        conv_states, slots.src, tree.parent_index, tree.num_tokens, xs, weight, weight if bias is None else bias,
        out, windows, num_inputs, conv_dim,
        conv_states.stride(0), conv_states.stride(1), windows.stride(0), windows.stride(1), xs.stride(0), xs.stride(1),
        D_CONV=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu", ACC=triton_dtype(acc),
        BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(weight.shape[1]),
    )
    return out, windows


def mamba2_tree(ssm_states, slots, tree, x, dt, A, B, C, D):
    """ssm_states [slots, nheads, headdim, d_state]; x [batch, T, nheads, headdim]; dt [batch, T, nheads];
    B, C [batch, T, ngroups, d_state]
    -> (y [batch, T, nheads, headdim], states [batch, T, nheads, headdim, d_state])."""
    check_mamba2_verify_args(ssm_states, None, None, x, dt, A, B, C, D, None)
    batch, num_inputs, nheads, headdim = x.shape
    check_tree_args(ssm_states, slots, tree, batch, num_inputs, "mamba2_tree_ref")
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    y, states = torch.zeros_like(x), states_buffer(ssm_states, batch, num_inputs, acc)
    block_p, block_n, num_warps = state_block_sizes(headdim, B.shape[3])
    _mamba2_tree_kernel[(batch, nheads, triton.cdiv(headdim, block_p))](
        ssm_states, slots.src, tree.parent_index, tree.num_tokens, x, dt, A, B, C, D, y, states,
        num_inputs, headdim, B.shape[3], nheads // B.shape[2],
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), states.stride(0), states.stride(1),
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
        ACC=triton_dtype(acc), BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, states


def mamba1_tree(ssm_states, slots, tree, x, dt, A, B, C, D):
    """ssm_states [slots, d_inner, d_state]; x, dt [batch, T, d_inner]; B, C [batch, T, d_state]
    -> (y [batch, T, d_inner], states [batch, T, d_inner, d_state])."""
    check_mamba1_verify_args(ssm_states, None, None, x, dt, A, B, C, D, None)
    batch, num_inputs, d_inner = x.shape
    check_tree_args(ssm_states, slots, tree, batch, num_inputs, "mamba1_tree_ref")
    acc = accumulate_dtype(ssm_states, x, dt, A, B, C, D)
    y, states = torch.zeros_like(x), states_buffer(ssm_states, batch, num_inputs, acc)
    block_d, block_n, num_warps = state_block_sizes(d_inner, A.shape[1])
    _mamba1_tree_kernel[(batch, triton.cdiv(d_inner, block_d))](
        ssm_states, slots.src, tree.parent_index, tree.num_tokens, x, dt, A, B, C, D, y, states,
        num_inputs, d_inner, A.shape[1],
        ssm_states.stride(0), ssm_states.stride(1), states.stride(0), states.stride(1),
        x.stride(0), x.stride(1), B.stride(0), B.stride(1),
        ACC=triton_dtype(acc), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, states


def gdn_tree(states, slots, tree, q, k, v, g, beta):
    """states [slots, HV, d_k, d_v]; q, k [batch, T, HK, d_k]; v [batch, T, HV, d_v]; g, beta [batch, T, HV]
    -> (o [batch, T, HV, d_v], states [batch, T, HV, d_k, d_v])."""
    check_gdn_verify_args(states, None, None, q, k, v, g, beta, None)
    batch, num_inputs, heads, d_v = v.shape
    check_tree_args(states, slots, tree, batch, num_inputs, "gdn_tree_ref")
    acc = accumulate_dtype(states, q, k, v, g, beta)
    o, node_states = torch.zeros_like(v), states_buffer(states, batch, num_inputs, acc)
    block_k, block_v, num_warps = gdn_block_sizes(k.shape[3], d_v)
    _gdn_tree_kernel[(batch, heads, triton.cdiv(d_v, block_v))](
        states, slots.src, tree.parent_index, tree.num_tokens, q, k, v, g, beta, o, node_states,
        num_inputs, k.shape[3], d_v, heads // k.shape[2],
        states.stride(0), states.stride(1), states.stride(2), node_states.stride(0), node_states.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        ACC=triton_dtype(acc), BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )
    return o, node_states
