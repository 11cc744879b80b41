"""The Triton tree kernels of the conv window and the recurrences
(kernels/triton/tree_recurrences.py) == their torch tree forms (tree_verify)
on tiny trees: a chain, a star, a deep branch and a forest (two inputs whose
parent is the head) in one padded batch, every output and every input's
state; the pool untouched. A tree whose parents form a chain == the chain
kernel, outputs and snapshots."""

import pytest
import torch

from hybridspec.cache.tree_plan import TreePlan
from hybridspec.kernels.slot_plan import SlotPlan
from hybridspec.kernels.triton import tree_verify
from hybridspec.kernels.triton.conv_window import conv_window_update
from hybridspec.kernels.triton.gdn_verify import gdn_verify
from hybridspec.kernels.triton.mamba1_verify import mamba1_verify
from hybridspec.kernels.triton.mamba2_verify import mamba2_verify
from hybridspec.kernels.triton.tree_recurrences import conv_window_tree, gdn_tree, mamba1_tree, mamba2_tree
from slot_plan import TOLERANCES

CHAIN = [-1, 0, 1, 2, 3]
STAR = [-1, 0, 0, 0]
DEEP_BRANCH = [-1, 0, 1, 2, 1, 4, 5]  # a second branch from input 1, longer than the conv window
FOREST = [-1, 0, -1, 2, 0]
SRC = [3, 0, 5, 1]  # each row's head slot
NUM_SLOTS = 7


def rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def conv_case(gen, dtype, batch, T):
    conv_dim, d_conv = 5, 4
    return [rand(gen, NUM_SLOTS, conv_dim, d_conv - 1, dtype=dtype), rand(gen, batch, T, conv_dim, dtype=dtype),
            rand(gen, conv_dim, d_conv, dtype=dtype), rand(gen, conv_dim, dtype=dtype), "silu"]


def mamba2_case(gen, dtype, batch, T, nheads=4, headdim=3, d_state=5, ngroups=2):
    return [rand(gen, NUM_SLOTS, nheads, headdim, d_state, dtype=dtype),
            rand(gen, batch, T, nheads, headdim, dtype=dtype),
            torch.nn.functional.softplus(rand(gen, batch, T, nheads, dtype=dtype)),
            -torch.exp(rand(gen, nheads, dtype=dtype) * 0.5),
            rand(gen, batch, T, ngroups, d_state, dtype=dtype), rand(gen, batch, T, ngroups, d_state, dtype=dtype),
            rand(gen, nheads, dtype=dtype)]


def mamba1_case(gen, dtype, batch, T, d_inner=5, d_state=3):
    return [rand(gen, NUM_SLOTS, d_inner, d_state, dtype=dtype), rand(gen, batch, T, d_inner, dtype=dtype),
            torch.nn.functional.softplus(rand(gen, batch, T, d_inner, dtype=dtype)),
            -torch.exp(rand(gen, d_inner, d_state, dtype=dtype) * 0.5),
            rand(gen, batch, T, d_state, dtype=dtype), rand(gen, batch, T, d_state, dtype=dtype),
            rand(gen, d_inner, dtype=dtype)]


def gdn_case(gen, dtype, batch, T, heads=4, key_heads=2, d_k=4, d_v=3):
    q, k = (torch.nn.functional.normalize(rand(gen, batch, T, key_heads, d_k, dtype=dtype), dim=-1) for _ in range(2))
    return [rand(gen, NUM_SLOTS, heads, d_k, d_v, dtype=dtype), q * d_k ** -0.5, k,
            rand(gen, batch, T, heads, d_v, dtype=dtype),
            -torch.nn.functional.softplus(rand(gen, batch, T, heads, dtype=dtype)),
            torch.sigmoid(rand(gen, batch, T, heads, dtype=dtype))]


# name -> (Triton kernel, torch tree form, case, chain kernel)
OPS = {
    "conv_window": (conv_window_tree, tree_verify.conv_window_tree_ref, conv_case, conv_window_update),
    "mamba2": (mamba2_tree, tree_verify.mamba2_tree_ref, mamba2_case, mamba2_verify),
    "mamba1": (mamba1_tree, tree_verify.mamba1_tree_ref, mamba1_case, mamba1_verify),
    "gdn": (gdn_tree, tree_verify.gdn_tree_ref, gdn_case, gdn_verify),
}


def plans(parents, device):
    """The forward's slots (head slots SRC, no snapshot) and the tree."""
    T = max(map(len, parents))
    slots = SlotPlan(SRC[:len(parents)], [[-1] * T for _ in parents], [len(p) for p in parents], device)
    return slots, TreePlan(parents, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", OPS)
def test_tree_kernel_matches_the_torch_tree_form(name, dtype, triton_device):
    kernel, reference, make_case, _ = OPS[name]
    parents = [CHAIN, STAR, DEEP_BRANCH, FOREST]
    slots, tree = plans(parents, triton_device)
    args = make_case(torch.Generator().manual_seed(1), dtype, len(parents), tree.num_inputs)
    args = [a.to(triton_device) if isinstance(a, torch.Tensor) else a for a in args]
    pool = args[0].clone()
    got_out, got_states = kernel(args[0], slots, tree, *args[1:])
    want_out, want_states = reference(pool, slots, tree, *args[1:])
    assert got_out.dtype == want_out.dtype and got_states.dtype == want_states.dtype
    torch.testing.assert_close(got_out, want_out, **TOLERANCES[dtype])
    torch.testing.assert_close(got_states, want_states, **TOLERANCES[dtype])
    assert torch.equal(args[0], pool), "the pool changed"
    for b, row in enumerate(parents):  # padding inputs: zero outputs and states
        assert not got_out[b, len(row):].any() and not got_states[b, len(row):].any()


@pytest.mark.parametrize("name", OPS)
def test_a_chain_tree_is_the_chain_kernel(name, triton_device):
    """Parents [-1, 0, 1, …]: the chain kernel's outputs, and its snapshot after each input is the tree's state."""
    kernel, _, make_case, chain_kernel = OPS[name]
    parents = [CHAIN, CHAIN[:3]]
    slots, tree = plans(parents, triton_device)
    T = tree.num_inputs
    args = make_case(torch.Generator().manual_seed(2), torch.float32, len(parents), T)
    args = [a.to(triton_device) if isinstance(a, torch.Tensor) else a for a in args]
    got_out, got_states = kernel(args[0].clone(), slots, tree, *args[1:])
    pool = torch.cat([args[0], args[0].new_zeros(len(parents) * T, *args[0].shape[1:])])  # room for every snapshot
    snap = torch.arange(NUM_SLOTS, NUM_SLOTS + len(parents) * T, device=triton_device).view(len(parents), T)
    chain_out = chain_kernel(pool, slots.src, snap, *args[1:], tree.num_tokens) if name != "conv_window" else \
        chain_kernel(pool, slots.src, snap, args[1], args[2], args[3], tree.num_tokens, args[4])
    torch.testing.assert_close(got_out, chain_out, rtol=0, atol=0)
    for b, row in enumerate(parents):
        torch.testing.assert_close(got_states[b, :len(row)], pool[snap[b, :len(row)]], rtol=0, atol=0)
