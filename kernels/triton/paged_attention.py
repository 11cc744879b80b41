"""Paged attention for decode and verification: 1..T query tokens per sequence
attend causally to that sequence's keys, read through its block table.

Symbols
  b        batch row (one sequence)
  t        query token of row b, t < query_lens[b]; rows t >= query_lens[b] are padding
  pos(t)   absolute position of query t: context_lens[b] - query_lens[b] + t
  s        key position, 0 <= s <= pos(t)
  page     block_tables[b, s // block_size]; key s lives at slot s % block_size of that page

  out[b, t, h] = sum_s softmax_s(scale * q[b, t, h] . k[s, h // G]) v[s, h // G]     (G = num_q_heads / num_kv_heads)

The query tokens' own K/V must already be in the cache (write before attend).
Block table entries past a row's last page are never read (pad them with -1).

Three implementations of the same math:
  paged_attention       Triton kernel (CUDA): online softmax over key tiles read through the block table
  paged_attention_cpu   CPU: each row's pages as runs of consecutive pages (`page_runs`), read as one
                        view of the cache when they form a single run (no copy), then
                        `scaled_dot_product_attention` per row
  paged_attention_ref   reference: gather every position, explicit masked softmax
"""

import os

import torch
import torch.nn.functional as F

from hybridspec.kernels.reference import gather_pages
from hybridspec.kernels.triton.triton_import import tl, triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 models attend with the reference
_BLOCK_N = 64  # key positions per inner step; independent of the page size


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, context_lens_ptr, query_lens_ptr, ancestors_ptr,
    scale, T_max,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_tb, stride_tn, stride_ab,
    TREE: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: row b, query head h, BLOCK_M query tokens; online softmax over key tiles.
    # Tiles are upcast to float32 (exact dot products, and the interpreter's bf16 dot is wrong).
    # TREE: query t sees the keys before its row's first query and, among the queries' own, those whose
    # bit is set in ancestors[b, t] (`tree_attention`); ancestors precede t, so the causal bound holds.
    b = tl.program_id(0).to(tl.int64)  # int64 offsets: batch × T × heads × head_dim can pass 2^31 in a prefill
    h = tl.program_id(1)
    m_tile = tl.program_id(2)
    kv_h = h // GROUP

    context_len = tl.load(context_lens_ptr + b)
    query_len = tl.load(query_lens_ptr + b)
    first_pos = context_len - query_len  # absolute position of query token 0

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # query token index t
    offs_d = tl.arange(0, BLOCK_D)
    is_query = offs_m < query_len
    is_dim = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=is_query[:, None] & is_dim[None, :], other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    q_pos = first_pos + offs_m
    if TREE:
        ancestors = tl.load(ancestors_ptr + b * stride_ab + offs_m, mask=is_query, other=0)  # [BLOCK_M] int64

    # Keys this tile can see end at its last query position; a tile of padding sees none.
    num_keys = tl.minimum(context_len, first_pos + (m_tile + 1) * BLOCK_M)
    num_keys = tl.where(m_tile * BLOCK_M < query_len, num_keys, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, num_keys, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        is_key = k_pos < num_keys
        page = tl.load(block_tables_ptr + b * stride_tb + (k_pos // BLOCK_SIZE) * stride_tn,
                       mask=is_key, other=0).to(tl.int64)
        in_page = k_pos % BLOCK_SIZE
        kv_mask = is_key[:, None] & is_dim[None, :]
        k = tl.load(
            k_cache_ptr + page[:, None] * stride_kb + in_page[:, None] * stride_ks
            + kv_h * stride_kh + offs_d[None, :] * stride_kd,
            mask=kv_mask, other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_cache_ptr + page[:, None] * stride_vb + in_page[:, None] * stride_vs
            + kv_h * stride_vh + offs_d[None, :] * stride_vd,
            mask=kv_mask, other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        is_visible = (k_pos[None, :] <= q_pos[:, None]) & is_key[None, :] & is_query[:, None]
        if TREE:
            own = k_pos - first_pos  # key index among the row's queries, negative for the context before them
            bit = (ancestors[:, None] >> tl.minimum(tl.maximum(own, 0), 63)[None, :]) & 1
            is_visible = is_visible & ((own < 0)[None, :] | (bit != 0))
        scores = tl.where(is_visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows: acc == 0
    tl.store(
        out_ptr + b * stride_ob + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_m < T_max)[:, None] & is_dim[None, :],
    )


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_lens) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables has shape {tuple(block_tables.shape)}; expected [{q.shape[0]}, max_blocks]")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables has dtype {block_tables.dtype}; expected int32 or int64")
    _check_tensors(q, k_cache, v_cache, context_lens, query_lens)
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device} but q on {q.device}; put all inputs on one device")


def _check_tensors(q, k_cache, v_cache, context_lens, query_lens) -> None:
    if q.dim() != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected [batch, T_max, num_q_heads, head_dim]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    batch, _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    for name, lens in (("context_lens", context_lens), ("query_lens", query_lens)):
        if lens.shape != (batch,):
            raise ValueError(f"{name} has shape {tuple(lens.shape)}; expected [{batch}]")
        if lens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} has dtype {lens.dtype}; expected int32 or int64")
    devices = {t.device for t in (q, k_cache, v_cache, context_lens, query_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def paged_attention(
    q: torch.Tensor,  # [batch, T_max, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32/int64, padded with -1
    context_lens: torch.Tensor,  # [batch] keys each row sees, its query tokens included
    query_lens: torch.Tensor,  # [batch] query tokens per row, <= context_lens
    scale: float,
) -> torch.Tensor:  # [batch, T_max, num_q_heads, head_dim], zeros in padding rows
    """Triton paged attention; see the module docstring for the math."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_lens)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the kernel supports {SUPPORTED_DTYPES}, use paged_attention_ref")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("paged_attention needs CUDA tensors (or TRITON_INTERPRET=1); use paged_attention_ref on CPU")
    batch, T_max, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(T_max)))
    grid = (batch, num_q_heads, triton.cdiv(T_max, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, context_lens, query_lens, query_lens,
        scale, T_max,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *block_tables.stride(), 0,
        TREE=False, GROUP=num_q_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out


def row_pages(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    runs: tuple[tuple[int, int], ...],  # (first_page, num_pages) runs of one row's block table
    length: int,  # positions of the row to return, <= block_size * total pages
) -> torch.Tensor:  # [length, num_kv_heads, head_dim]
    """Positions 0..length-1 of one row: a view of `cache` when the pages are one run, else a copy of them."""
    pages = [cache[first:first + num] for first, num in runs]
    stored = pages[0] if len(pages) == 1 else torch.cat(pages)  # [num_pages, block_size, heads, dim]
    return stored.flatten(0, 1)[:length]


def _attend_row(
    q: torch.Tensor,  # [n, num_q_heads, head_dim]: the row's query tokens, at positions ctx - n .. ctx - 1
    k: torch.Tensor,  # [ctx, num_kv_heads, head_dim]
    v: torch.Tensor,  # [ctx, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [n, num_q_heads, head_dim]
    n, num_q_heads, head_dim = q.shape
    ctx, num_kv_heads = k.shape[:2]
    if n == 1 and q.dtype in (torch.float32, torch.float64):
        # decode: the G query heads of one KV head are G query rows of it, and see every key; two bmm
        # and a softmax dispatch a third of the operations scaled_dot_product_attention does here
        scores = torch.bmm(q.view(num_kv_heads, -1, head_dim), k.permute(1, 2, 0))  # [kv_heads, G, ctx]
        weights = torch.softmax(scores.mul_(_scale_constant(scale, q)), dim=-1)
        return torch.bmm(weights, v.transpose(0, 1)).view(1, num_q_heads, head_dim)
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, num_kv_heads, ctx, head_dim], strided views
    if n == 1:
        out = F.scaled_dot_product_attention(q.reshape(1, num_kv_heads, -1, head_dim), k, v, scale=scale)
        return out.reshape(1, num_q_heads, head_dim)
    # query t sees keys s <= ctx - n + t: plain causal when the row has no earlier context (a prefill)
    mask = None if n == ctx else torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)  # [1, num_q_heads, n, head_dim]
    return out[0].transpose(0, 1)


_SCALES: dict[tuple, torch.Tensor] = {}


def _scale_constant(scale: float, like: torch.Tensor) -> torch.Tensor:
    """The softmax scale as a cached 0-d tensor (a Python float costs four more operations)."""
    key = (scale, like.dtype, str(like.device))
    if key not in _SCALES:
        _SCALES[key] = torch.tensor(scale, dtype=like.dtype, device=like.device)
    return _SCALES[key]


def paged_attention_cpu(
    q: torch.Tensor,  # [batch, T_max, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    page_runs: tuple[tuple[tuple[int, int], ...], ...],  # per row: its block table as (first_page, num_pages) runs
    context_lens,  # [batch] tensor, or the same on the host (a list: nothing is read back)
    query_lens,  # [batch] tensor or list
    scale: float,
) -> torch.Tensor:  # [batch, T_max, num_q_heads, head_dim], zeros in padding rows
    """Row by row: K/V through `row_pages` (a view for a single run of pages), then
    attention over them, so no step re-gathers or masks the whole padded context."""
    if len(page_runs) != q.shape[0]:
        raise ValueError(f"{len(page_runs)} rows of page_runs for a batch of {q.shape[0]}; pass one per row")
    if isinstance(context_lens, torch.Tensor):
        _check_tensors(q, k_cache, v_cache, context_lens, query_lens)
        context_lens, query_lens = context_lens.tolist(), query_lens.tolist()
    if q.shape[0] == 1 and query_lens[0] == q.shape[1]:  # one full row: its attention is the output
        return _attend_row(q[0], row_pages(k_cache, page_runs[0], context_lens[0]),
                           row_pages(v_cache, page_runs[0], context_lens[0]), scale)[None]
    out = torch.zeros_like(q)
    for b, (runs, ctx, n) in enumerate(zip(page_runs, context_lens, query_lens)):
        if n:
            k, v = row_pages(k_cache, runs, ctx), row_pages(v_cache, runs, ctx)
            out[b, :n] = _attend_row(q[b, :n], k, v, scale)
    return out


def paged_attention_ref(
    q: torch.Tensor,  # [batch, T_max, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32/int64, padded with -1
    context_lens: torch.Tensor,  # [batch]
    query_lens: torch.Tensor,  # [batch]
    scale: float,
) -> torch.Tensor:  # [batch, T_max, num_q_heads, head_dim], zeros in padding rows
    """Gather the pages, then explicit causal softmax attention in float32 (float64 for float64 q)."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_lens)
    batch, T_max, num_q_heads, _ = q.shape
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = num_q_heads // k_cache.shape[2]
    k = gather_pages(k_cache, block_tables, context_lens).to(compute_dtype).repeat_interleave(group, dim=2)
    v = gather_pages(v_cache, block_tables, context_lens).to(compute_dtype).repeat_interleave(group, dim=2)
    # k, v: [batch, max_context, num_q_heads, head_dim]
    scores = torch.einsum("bthd,bshd->bhts", q.to(compute_dtype), k) * scale  # [batch, heads, T_max, max_context]
    t = torch.arange(T_max, device=q.device)
    q_pos = (context_lens - query_lens)[:, None] + t[None, :]  # [batch, T_max]
    is_query = t[None, :] < query_lens[:, None]  # [batch, T_max]
    k_pos = torch.arange(k.shape[1], device=q.device)
    is_visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & is_query[:, :, None]  # [batch, T_max, max_context]
    scores = scores.masked_fill(~is_visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(is_query[:, None, :, None], probs, 0.0)  # padding rows saw no key: NaN -> 0
    out = torch.einsum("bhts,bshd->bthd", probs, v)  # [batch, T_max, num_q_heads, head_dim]
    return out.to(q.dtype)
