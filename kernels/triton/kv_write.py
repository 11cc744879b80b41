"""Scatter one forward's new K and V into the pages of the paged KV cache.

`slot_mapping [batch, T]` names, for input t of row b, the flat cache slot
`page · block_size + offset` its K and V go to, or -1 for nothing (a padding
input, or a position whose K/V is already cached). Every launch has the same
shape for a given [batch, T], whatever the slots are: no index list of the
live inputs is built on the host, so the write can sit inside a captured CUDA
graph (`hybridspec.models.graphs`) and be replayed with other slots.

Slots named by two inputs are not allowed (the cache never does).
"""

import torch

from hybridspec.kernels.triton.triton_import import tl, triton


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    row_size,
    stride_k_in, stride_v_in, stride_k_slot, stride_v_slot,
    BLOCK: tl.constexpr,
):
    # One program per (input, block of the heads·head_dim values of one row).
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i).to(tl.int64)  # int64 offsets whatever the mapping's type
    if slot >= 0:
        mask = offs < row_size
        k = tl.load(k_ptr + i * stride_k_in + offs, mask=mask)
        v = tl.load(v_ptr + i * stride_v_in + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_k_slot + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * stride_v_slot + offs, v, mask=mask)


def check_kv_write_args(k_flat, v_flat, slot_mapping, k, v) -> None:
    """k_flat, v_flat [slots, heads, head_dim]; k, v [batch, T, heads, head_dim]; slot_mapping [batch, T] int."""
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"k and v must be one [batch, T, heads, head_dim] shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if tuple(slot_mapping.shape) != tuple(k.shape[:2]):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected {tuple(k.shape[:2])} "
                         "[batch, T]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping has dtype {slot_mapping.dtype}; expected int32 or int64")
    for name, cache in (("k_flat", k_flat), ("v_flat", v_flat)):
        if cache.dim() != 3 or tuple(cache.shape[1:]) != tuple(k.shape[2:]):
            raise ValueError(f"{name} has shape {tuple(cache.shape)}; expected [slots, {k.shape[2]}, {k.shape[3]}]")
        if cache.dtype != k.dtype:
            raise ValueError(f"{name} holds {cache.dtype} but k is {k.dtype}")
        if cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
            raise ValueError(f"{name}'s rows must be contiguous [heads, head_dim]")


def kv_write(k_flat, v_flat, slot_mapping, k, v) -> None:
    """k_flat[slot_mapping[b, t]] = k[b, t] (and v likewise) wherever the slot is
    not -1; k_flat, v_flat [num_blocks · block_size, heads, head_dim], written in place."""
    check_kv_write_args(k_flat, v_flat, slot_mapping, k, v)
    batch, T, heads, head_dim = k.shape
    if batch * T == 0:
        return
    k, v, slots = k.reshape(batch * T, -1), v.reshape(batch * T, -1), slot_mapping.reshape(-1).contiguous()
    if k.stride(1) != 1 or v.stride(1) != 1:
        k, v = k.contiguous(), v.contiguous()
    row_size = heads * head_dim
    block = min(1024, triton.next_power_of_2(row_size))
    grid = (batch * T, triton.cdiv(row_size, block))
    _kv_write_kernel[grid](k, v, k_flat, v_flat, slots, row_size, k.stride(0), v.stride(0),
                           k_flat.stride(0), v_flat.stride(0), BLOCK=block)


def kv_write_ref(k_flat, v_flat, slot_mapping, k, v) -> None:
    """Plain-torch kv_write: the same writes."""
    check_kv_write_args(k_flat, v_flat, slot_mapping, k, v)
    slots = slot_mapping.reshape(-1)
    live = (slots >= 0).nonzero().flatten()
    for cache, x in ((k_flat, k), (v_flat, v)):
        cache.index_copy_(0, slots[live].long(), x.reshape(-1, *x.shape[2:]).index_select(0, live))
