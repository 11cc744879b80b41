"""`TreePlan`'s tensors for the Triton tree kernels: the padded parent indices,
the inputs per row, and the ancestor bitmasks, which say what `visible` says
(bit 63 the sign bit) and are refused past 64 inputs."""
import pytest
import torch

from hybridspec.cache.tree_plan import TreePlan

PARENTS = [[-1, 0, 0, 1, 3], [-1, 0, -1]]


def test_parent_index_and_num_tokens_pad_rows():
    plan = TreePlan(PARENTS, "cpu")
    assert plan.parent_index.tolist() == [[-1, 0, 0, 1, 3], [-1, 0, -1, -1, -1]]
    assert plan.num_tokens.tolist() == [5, 3]


@pytest.mark.parametrize("parents", [PARENTS, [[-1] + list(range(63))], [[-1] + [0] * 63]],
                         ids=["small", "a chain of 64", "a star of 64"])
def test_ancestor_bits_are_visible_as_bitmasks(parents):
    plan = TreePlan(parents, "cpu")
    bits = plan.ancestor_bits  # [batch, T] int64
    for b, visible in enumerate(plan.visible):
        n = visible.shape[0]
        unpacked = (bits[b, :n, None] >> torch.arange(n)) & 1  # [n, n]
        assert torch.equal(unpacked.bool(), visible)
        assert not bits[b, n:].any()


def test_ancestor_bits_refuse_more_than_64_inputs():
    with pytest.raises(ValueError, match="64 inputs"):
        TreePlan([[-1] + list(range(64))], "cpu").ancestor_bits
