"""Paged attention: the reference and the CPU path against a dense per-token
softmax (float64), the Triton kernel against the reference, and all three on
metadata from PagedKVCache."""

import math

import pytest
import torch

from hybridspec.cache import PagedKVCache
from hybridspec.cache.block_pool import consecutive_runs
from hybridspec.kernels.triton.paged_attention import paged_attention, paged_attention_cpu, paged_attention_ref, row_pages

pytest.importorskip("triton")

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def make_case(context_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size,
              dtype=torch.float64, table_dtype=torch.int32, seed=0, shuffle=True):
    """Random K/V per sequence scattered over shuffled pages (consecutive pages from page 1
    with shuffle=False); unused pages and slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(pages_per_row) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist() if shuffle else list(range(1, num_blocks))
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.float64)
    v_cache = k_cache.clone()
    keys, values, tables = [], [], []
    for ctx, n in zip(context_lens, pages_per_row):
        table, order = order[:n], order[n:]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)  # [ctx, heads, dim]
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        for p in range(ctx):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
        tables.append(table)
    max_blocks = max(pages_per_row)
    block_tables = torch.tensor([t + [-1] * (max_blocks - len(t)) for t in tables], dtype=table_dtype)
    q = torch.randn(len(context_lens), max(query_lens), num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                context_lens=torch.tensor(context_lens), query_lens=torch.tensor(query_lens),
                scale=head_dim**-0.5)
    return {n: t.to(dtype) if n in ("q", "k_cache", "v_cache") else t for n, t in case.items()}, keys, values


def dense_attention(q, keys, values, context_lens, query_lens, scale):
    """Token by token: query t of row b sees keys 0..ctx - qlen + t of its own sequence."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[2] // keys[0].shape[1]
    for b, (ctx, qlen) in enumerate(zip(context_lens, query_lens)):
        for t in range(qlen):
            pos = ctx - qlen + t
            for h in range(q.shape[2]):
                k, v = keys[b][: pos + 1, h // group], values[b][: pos + 1, h // group]  # [pos + 1, dim]
                weights = torch.softmax(scale * (k @ q[b, t, h].double()), dim=0)
                out[b, t, h] = weights @ v
    return out


def cpu_args(case):
    """The case with its block tables as the page runs paged_attention_cpu reads."""
    runs = tuple(tuple(consecutive_runs([p for p in row if p >= 0])) for row in case["block_tables"].tolist())
    return {**{n: t for n, t in case.items() if n != "block_tables"}, "page_runs": runs}


def to(case, device):
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in case.items()}


CASES = {
    # name: context_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size
    "decode_gqa": ([1, 5, 13], [1, 1, 1], 4, 2, 8, 4),
    "verify_ragged": ([9, 2, 6], [4, 2, 0], 2, 2, 12, 3),  # row 2 has no query token
    "page_of_one": ([7, 3], [3, 3], 3, 1, 4, 1),
    "prefill_many_tiles": ([70, 90], [70, 20], 1, 1, 8, 16),  # 2 query tiles, 2 key tiles
}


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_dense_attention(name):
    context_lens, query_lens, *shape = CASES[name]
    case, keys, values = make_case(context_lens, query_lens, *shape)
    expected = dense_attention(case["q"], keys, values, context_lens, query_lens, case["scale"])
    torch.testing.assert_close(paged_attention_ref(**case), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shuffle", [True, False], ids=["scattered_pages", "consecutive_pages"])
@pytest.mark.parametrize("name", CASES)
def test_cpu_path_matches_dense_attention(name, shuffle):
    context_lens, query_lens, *shape = CASES[name]
    case, keys, values = make_case(context_lens, query_lens, *shape, shuffle=shuffle)
    expected = dense_attention(case["q"], keys, values, context_lens, query_lens, case["scale"])
    out = paged_attention_cpu(**cpu_args(case))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    is_padding = torch.arange(out.shape[1])[None, :] >= case["query_lens"][:, None]  # [batch, T_max]
    assert torch.all(out[is_padding] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference_in_low_precision(dtype):
    case, _, _ = make_case([9, 30, 5], [1, 4, 5], 4, 2, 8, 4, dtype=dtype)
    torch.testing.assert_close(paged_attention_cpu(**cpu_args(case)), paged_attention_ref(**case),
                               **TOLERANCES[dtype])


def test_row_pages_is_a_view_of_one_run_and_a_copy_of_several():
    cache = torch.arange(6 * 2 * 1 * 1.0).reshape(6, 2, 1, 1)  # [num_blocks, block_size, heads, dim]: slot ids
    one = row_pages(cache, ((2, 3),), 5)
    assert one.flatten().tolist() == [4, 5, 6, 7, 8] and one.data_ptr() == cache[2].data_ptr()
    several = row_pages(cache, ((4, 1), (0, 2)), 5)
    assert several.flatten().tolist() == [8, 9, 0, 1, 2]
    assert several.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()


def test_cpu_path_rejects_bad_inputs():
    args = cpu_args(make_case([4, 6], [1, 2], 4, 2, 8, 4)[0])
    with pytest.raises(ValueError, match="1 rows of page_runs for a batch of 2"):
        paged_attention_cpu(**{**args, "page_runs": args["page_runs"][:1]})
    with pytest.raises(ValueError, match="num_q_heads=3 is not a multiple"):
        paged_attention_cpu(**{**args, "q": args["q"][:, :, :3]})


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(name, dtype, triton_device):
    context_lens, query_lens, *shape = CASES[name]
    case, _, _ = make_case(context_lens, query_lens, *shape, dtype=dtype, table_dtype=torch.int64)
    expected = paged_attention_ref(**case)
    out = paged_attention(**to(case, triton_device)).cpu()
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    is_padding = torch.arange(out.shape[1])[None, :] >= case["query_lens"][:, None]  # [batch, T_max]
    assert torch.all(out[is_padding] == 0)


def test_kernel_reads_strided_q_and_float16(triton_device):
    case, _, _ = make_case([6, 11], [2, 3], 4, 2, 8, 4, dtype=torch.float16)
    qkv = torch.randn(2, 3, 8, 8, dtype=torch.float16)  # [batch, T_max, q + k + v heads, dim]
    case["q"] = qkv[:, :, :4]  # not contiguous
    out = paged_attention(**to(case, triton_device)).cpu()
    torch.testing.assert_close(out, paged_attention_ref(**case), **TOLERANCES[torch.float16])


def test_cache_metadata_drives_both_paths(triton_device):
    """prepare_write + write, then attention over the cache's own block tables (int32, -1 padded)."""
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(2, 12, 4, 2, 8, torch.float32, triton_device)
    prompts = [7, 2]
    for s in (0, 1):
        cache.add_sequence(s)
    keys, values = [], []
    for num_new in (prompts, [3, 1]):  # a prefill, then a verify-sized step
        meta = cache.prepare_write([0, 1], num_new)
        k = torch.randn(2, max(num_new), 2, 8, generator=gen)  # [batch, T_max, heads, dim]
        v = torch.randn(2, max(num_new), 2, 8, generator=gen)
        cache.write(1, meta, k.to(triton_device), v.to(triton_device))
        for s, n in enumerate(num_new):
            cache.commit(s, cache.kv_len(s) + n)
            keys.append((s, k[s, :n]))
            values.append((s, v[s, :n]))
    seq_k = [torch.cat([k for s, k in keys if s == row]).double() for row in (0, 1)]
    seq_v = [torch.cat([v for s, v in values if s == row]).double() for row in (0, 1)]
    q = torch.randn(2, 3, 4, 8, generator=gen)
    args = (q.to(triton_device), cache.k_cache[1], cache.v_cache[1], meta.block_tables, meta.context_lens,
            meta.query_lens, 8**-0.5)
    expected = dense_attention(q, seq_k, seq_v, [10, 3], [3, 1], 8**-0.5).float()
    torch.testing.assert_close(paged_attention_ref(*args).cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_attention(*args).cpu(), expected, rtol=1e-5, atol=1e-5)
    cpu = paged_attention_cpu(q, cache.k_cache[1].cpu(), cache.v_cache[1].cpu(), meta.page_runs,
                              meta.context_lens.cpu(), meta.query_lens.cpu(), 8**-0.5)
    torch.testing.assert_close(cpu, expected, rtol=1e-5, atol=1e-5)


def test_launcher_rejects_bad_inputs(triton_device):
    case, _, _ = make_case([4], [1], 4, 2, 8, 4, dtype=torch.float32)
    case = to(case, triton_device)
    bad = {
        "num_q_heads=3 is not a multiple": dict(q=case["q"][:, :, :3]),
        "dtypes differ": dict(v_cache=case["v_cache"].double()),
        r"block_tables has shape \(2, 1\)": dict(block_tables=case["block_tables"].repeat(2, 1)),
        "query_lens has shape": dict(query_lens=case["query_lens"][:0]),
        "context_lens has dtype": dict(context_lens=case["context_lens"].float()),
        "head_dim": dict(q=case["q"][..., :4]),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            paged_attention(**{**case, **change})
    with pytest.raises(ValueError, match="use paged_attention_ref"):
        paged_attention(**{**case, "q": case["q"].double(), "k_cache": case["k_cache"].double(),
                           "v_cache": case["v_cache"].double()})
