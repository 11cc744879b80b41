"""Paged attention over a tree of inputs: the Triton form of
`tree_verify.tree_attention_ref` (same signature): paged_attention.py's
kernel launched with TREE set, each query masked to its ancestors.

Row b's n query inputs have their K/V at the last n positions of its context
(input s at context_lens[b] - n + s, where the caller wrote them); input t sees
every key before those and input s where s is t or an ancestor of t, given as
bit s of `tree.ancestor_bits[b, t]` (`TreePlan`), so a tree holds at most 64
inputs. Since a node's ancestors precede it, this is the chain's causal mask
with the other branches' keys taken out.
"""
from __future__ import annotations

import torch

from hybridspec.kernels.triton.paged_attention import (_BLOCK_N, SUPPORTED_DTYPES, _check_inputs,
                                                       _paged_attention_kernel)
from hybridspec.kernels.triton.mamba2_verify import check_kernel_device
from hybridspec.kernels.triton.triton_import import triton

MAX_INPUTS = 64  # the bits of an ancestor mask


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, tree,
                   scale: float) -> torch.Tensor:
    """q [batch, T, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
    `meta`: the forward's K/V plan (block_tables, context_lens, query_lens); `tree`: its `TreePlan`
    -> [batch, T, heads, head_dim], zero on padding."""
    _check_inputs(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the kernel supports {SUPPORTED_DTYPES}, use tree_attention_ref")
    batch, T_max = q.shape[:2]
    if (tree.batch, tree.num_inputs) != (batch, T_max) or T_max > MAX_INPUTS:
        raise ValueError(f"tree is {tree.batch} rows of {tree.num_inputs} inputs for q's {batch} rows of {T_max}; "
                         f"pass the forward's TreePlan (at most {MAX_INPUTS} inputs, else tree_attention_ref)")
    check_kernel_device(q, "tree_attention_ref")
    ancestors = tree.ancestor_bits  # [batch, T] int64
    if ancestors.device != q.device:
        raise ValueError(f"the tree's masks are on {ancestors.device} but q on {q.device}; build the TreePlan on "
                         f"{q.device}")
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    num_q_heads, head_dim = q.shape[2:]
    block_m = min(64, max(16, triton.next_power_of_2(T_max)))
    _paged_attention_kernel[(batch, num_q_heads, triton.cdiv(T_max, block_m))](
        q, k_cache, v_cache, out,
        meta.block_tables, meta.context_lens, meta.query_lens, ancestors,
        scale, T_max,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *meta.block_tables.stride(), ancestors.stride(0),
        TREE=True, GROUP=num_q_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out
