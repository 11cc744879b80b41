"""Tree attention: the Triton kernel (kernels/triton/tree_attention.py) ==
the torch tree form (tree_verify.tree_attention_ref) on a chain, a star, a
deep branch and a forest in one padded batch, over pages that are not one
run; a chain tree == chain paged attention; a tree of 64 inputs (the mask's
sign bit) too, and a larger one is refused."""

import pytest
import torch

from hybridspec.cache.paged_kv import KVWriteMeta
from hybridspec.cache.tree_plan import TreePlan
from hybridspec.kernels.triton.paged_attention import paged_attention
from hybridspec.kernels.triton.tree_attention import tree_attention
from hybridspec.kernels.triton.tree_verify import tree_attention_ref

CHAIN = [-1, 0, 1, 2, 3]
STAR = [-1, 0, 0, 0]
DEEP_BRANCH = [-1, 0, 1, 2, 1, 4, 5]
FOREST = [-1, 0, -1, 2, 0]
BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def make_case(parents, committed, device, seed=0):
    """Row b: `committed[b]` context keys, then its inputs' own; its pages laid end to end,
    row 1's in reverse (a table that is not one run)."""
    gen = torch.Generator().manual_seed(seed)
    tables, page = [], 0
    context = [c + len(p) for c, p in zip(committed, parents)]
    for ctx in context:
        pages = list(range(page, page + -(-ctx // BLOCK_SIZE)))
        page += len(pages)
        tables.append(pages[::-1] if len(tables) == 1 else pages)
    T = max(map(len, parents))
    meta = KVWriteMeta(range(len(parents)), [[-1] * T for _ in parents], tables, context, [len(p) for p in parents],
                       device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = rand(len(parents), T, HEADS, HEAD_DIM)
    return q, rand(page, BLOCK_SIZE, KV_HEADS, HEAD_DIM), rand(page, BLOCK_SIZE, KV_HEADS, HEAD_DIM), meta


def test_tree_attention_matches_the_torch_tree_form(triton_device):
    parents = [CHAIN, STAR, DEEP_BRANCH, FOREST]
    q, k, v, meta = make_case(parents, [3, 6, 0, 9], triton_device)
    tree = TreePlan(parents, triton_device)
    got = tree_attention(q, k, v, meta, tree, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got, tree_attention_ref(q, k, v, meta, tree, HEAD_DIM ** -0.5), **TOLERANCE)
    for b, row in enumerate(parents):
        assert not got[b, len(row):].any(), "padding rows are zero"


def test_a_chain_tree_is_chain_paged_attention(triton_device):
    parents = [CHAIN, CHAIN[:2]]
    q, k, v, meta = make_case(parents, [5, 2], triton_device, seed=1)
    got = tree_attention(q, k, v, meta, TreePlan(parents, triton_device), HEAD_DIM ** -0.5)
    want = paged_attention(q, k, v, meta.block_tables, meta.context_lens, meta.query_lens, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got[1, :2], want[1, :2], rtol=0, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_a_tree_of_64_inputs_uses_every_bit(triton_device):
    gen = torch.Generator().manual_seed(2)
    parents = [[-1] + [int(torch.randint(max(0, t - 3), t, (1,), generator=gen)) for t in range(1, 64)]]
    q, k, v, meta = make_case(parents, [2], triton_device, seed=3)
    tree = TreePlan(parents, triton_device)
    torch.testing.assert_close(tree_attention(q, k, v, meta, tree, 0.3), tree_attention_ref(q, k, v, meta, tree, 0.3),
                               **TOLERANCE)


def test_a_tree_past_64_inputs_is_refused(triton_device):
    parents = [[-1] + list(range(64))]
    q, k, v, meta = make_case(parents, [0], triton_device)
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention(q, k, v, meta, TreePlan(parents, triton_device), 0.3)
