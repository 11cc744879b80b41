"""Gated DeltaNet multi-token update and log replay: the torch references ==
a naive per-token, per-head loop of the gated delta rule, for outputs and
every slot (written, and untouched)."""

import pytest
import torch

from hybridspec.kernels.gdn_verify import gdn_replay_ref, gdn_verify_ref
from slot_plan import NUM_TOKENS, SNAP, SRC, TOLERANCES, WRITTEN

NUM_SLOTS = 16


def make_case(dtype, heads=4, key_heads=2, d_k=6, d_v=5):
    batch, num_inputs = len(SNAP), len(SNAP[0])
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(rand(batch, num_inputs, key_heads, d_k), dim=-1) for _ in range(2))
    return dict(
        states=rand(NUM_SLOTS, heads, d_k, d_v).to(dtype),
        src_slot=torch.tensor(SRC), snap_slot=torch.tensor(SNAP),
        q=(q * d_k ** -0.5).to(dtype), k=k.to(dtype), v=rand(batch, num_inputs, heads, d_v).to(dtype),
        g=(-torch.nn.functional.softplus(rand(batch, num_inputs, heads))).to(dtype),
        beta=torch.sigmoid(rand(batch, num_inputs, heads)).to(dtype),
        num_tokens=torch.tensor(NUM_TOKENS),
    )


def naive(states, src, snap, q, k, v, g, beta, num_tokens):
    """The gated delta rule token by token, head by head, in float64."""
    states = states.double().clone()
    o = torch.zeros(v.shape, dtype=torch.float64)
    group = v.shape[2] // k.shape[2]
    for b in range(v.shape[0]):
        S = states[src[b]].clone()
        for t in range(int(num_tokens[b])):
            for h in range(v.shape[2]):
                kt, qt = k[b, t, h // group].double(), q[b, t, h // group].double()
                S[h] = torch.exp(g[b, t, h].double()) * S[h]
                u = beta[b, t, h].double() * (v[b, t, h].double() - S[h].T @ kt)
                S[h] = S[h] + torch.outer(kt, u)
                o[b, t, h] = S[h].T @ qt
            if snap[b][t] >= 0:
                states[snap[b][t]] = S
    return o, states


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_verify_ref_matches_naive_loop(dtype):
    case = make_case(dtype)
    before = case["states"].clone()
    want_o, want_states = naive(case["states"], SRC, SNAP, *(case[n] for n in ("q", "k", "v", "g", "beta")),
                                case["num_tokens"])
    o = gdn_verify_ref(**case)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(o.double(), want_o, **tol)
    torch.testing.assert_close(case["states"].double(), want_states, **tol)
    for slot in set(range(NUM_SLOTS)) - WRITTEN:
        assert torch.equal(case["states"][slot], before[slot]), f"slot {slot} was written"


def test_replay_ref_reaches_the_verify_snapshots():
    case = make_case(torch.float64)
    pool = case["states"].clone()
    gdn_verify_ref(**{**case, "states": pool})
    replayed = case["states"].clone()
    steps = torch.tensor([3, 2, 1, 0])
    dst = torch.tensor([15, 7, 11, -1])
    gdn_replay_ref(replayed, case["src_slot"], dst, steps, case["k"], case["v"], case["g"], case["beta"])
    torch.testing.assert_close(replayed[15], pool[3], rtol=1e-12, atol=1e-12)  # row 0 after input 2
    torch.testing.assert_close(replayed[7], pool[6], rtol=1e-12, atol=1e-12)  # row 1 after input 1
    torch.testing.assert_close(replayed[11], pool[10], rtol=1e-12, atol=1e-12)  # row 2 after input 0
    assert torch.equal(replayed[12], case["states"][12])  # row 3 writes nothing
