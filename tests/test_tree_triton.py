"""A tree forward on the Triton backend (its kernels interpreted on CPU
tensors, TRITON_INTERPRET=1, conftest.py): on a tiny float32 model with every
recurrent kind and attention, the Triton tree kernels (`ops.TritonTreeForms`)
give the torch tree forms' logits and every input's kept states within
float32 rounding (a chain passed as a tree is the chain kernel's:
tests/kernels/triton/test_tree_recurrences.py, test_tree_attention.py)."""
from __future__ import annotations

import os

import pytest
import torch

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.tree_batch import TreeBatch
from hybridspec.kernels import ops
from hybridspec.rollback.models import tiny_model
from native_switch import backend_of

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels run on CPU tensors only interpreted")

PROMPTS = [[5, 6, 7, 8], [11, 12, 13]]
PARENTS = [[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 0]]
TOKENS = [[PROMPTS[0][-1], 20, 21, 22, 23, 24], [PROMPTS[1][-1], 30, 31, 32]]
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, ("mamba2", "attention", "mamba1", "gdn"), dtype=torch.float32)


def prefilled(model) -> HybridCache:
    """The prompts but their last tokens (which the forward then takes), prefilled by the torch forms."""
    cache = HybridCache(model.config, max_seqs=2, num_blocks=16, block_size=4, ring_slots=4, dtype=model.dtype)
    with backend_of(model, "torch"):
        model.prefill(cache, [0, 1], [p[:-1] for p in PROMPTS])
    return cache


def forward(model, backend: str):
    """(logits [2, T, vocab], the TreeBatch with every input's states)."""
    cache, tree = prefilled(model), TreeBatch(PARENTS, "cpu")
    with backend_of(model, backend):
        assert isinstance(model.backend.tree_forms, ops.TritonTreeForms) == (backend == "triton")
        return model.extend(cache, [0, 1], TOKENS, tree=tree), tree


def test_triton_tree_forward_matches_the_torch_tree_forms(model):
    got, got_tree = forward(model, "triton")
    want, want_tree = forward(model, "torch")
    assert set(got_tree.ssm) == set(want_tree.ssm) == {0, 1, 2}
    for b, parents in enumerate(PARENTS):
        n = len(parents)
        torch.testing.assert_close(got[b, :n], want[b, :n], **TOLERANCE)
        for layer in got_tree.ssm:
            torch.testing.assert_close(got_tree.ssm[layer][b, :n], want_tree.ssm[layer][b, :n], **TOLERANCE)
            torch.testing.assert_close(got_tree.conv[layer][b, :n], want_tree.conv[layer][b, :n], **TOLERANCE)

