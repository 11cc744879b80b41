"""Gated DeltaNet multi-token update and log replay: the torch references ==
a naive per-token, per-head loop of the gated delta rule, and the Triton
kernels == the references, for outputs and every slot (written, and
untouched), with key heads shared by value heads."""

import pytest
import torch

from hybridspec.kernels.triton.gdn_verify import gdn_replay, gdn_replay_ref, gdn_verify, gdn_verify_ref
from slot_plan import NUM_TOKENS, SNAP, SRC, TOLERANCES, WRITTEN

NUM_SLOTS = 16


def make_case(dtype, heads=4, key_heads=2, d_k=6, d_v=5, device="cpu", src=SRC, snap=SNAP, num_tokens=NUM_TOKENS):
    batch, num_inputs = len(snap), len(snap[0])
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(rand(batch, num_inputs, key_heads, d_k), dim=-1) for _ in range(2))
    case = dict(
        states=rand(NUM_SLOTS, heads, d_k, d_v),
        src_slot=torch.tensor(src), snap_slot=torch.tensor(snap),
        q=q * d_k ** -0.5, k=k, v=rand(batch, num_inputs, heads, d_v),
        g=-torch.nn.functional.softplus(rand(batch, num_inputs, heads)),
        beta=torch.sigmoid(rand(batch, num_inputs, heads)),
        num_tokens=torch.tensor(num_tokens),
    )
    return {name: x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype) for name, x in case.items()}


def clone_case(case):
    return {name: value.clone() for name, value in case.items()}


def assert_untouched(before, after, written):
    for slot in range(before.shape[0]):
        if slot not in written:
            assert torch.equal(before[slot], after[slot]), f"slot {slot} changed"


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


KERNEL_SHAPES = [  # heads, key_heads, d_k, d_v
    (4, 2, 6, 5),  # key heads shared by pairs of value heads; one d_v block, masked rows and columns
    (2, 1, 128, 12),  # one key head for both; d_v in two blocks of 8 (gdn_block_sizes), the second masked
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_matches_reference(dtype, shape, triton_device):
    heads, key_heads, d_k, d_v = shape
    case = make_case(dtype, heads, key_heads, d_k, d_v, device=triton_device)
    by_kernel, by_ref = clone_case(case), clone_case(case)
    o_kernel = gdn_verify(**by_kernel)
    o_ref = gdn_verify_ref(**by_ref)
    assert o_kernel.dtype == dtype and o_kernel.shape == case["v"].shape
    torch.testing.assert_close(o_kernel, o_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(by_kernel["states"], by_ref["states"], **TOLERANCES[dtype])
    assert_untouched(case["states"], by_kernel["states"], WRITTEN)
    assert not o_kernel[2, 2:].any() and not o_kernel[3].any()  # padding inputs give zeros
    for name in ("src_slot", "snap_slot", "q", "k", "v", "g", "beta", "num_tokens"):
        assert torch.equal(by_kernel[name], case[name]), f"{name} was modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_plain_decode_updates_the_head_in_place(dtype, triton_device):
    src = [3, 7, 0]
    case = make_case(dtype, device=triton_device, src=src, snap=[[s] for s in src], num_tokens=[1, 1, 1])
    want_o, want_states = naive(case["states"].cpu(), src, [[s] for s in src],
                                *(case[n].cpu() for n in ("q", "k", "v", "g", "beta")), [1, 1, 1])
    for verify in (gdn_verify, gdn_verify_ref):
        work = clone_case(case)
        o = verify(**work)
        torch.testing.assert_close(o.double().cpu(), want_o, **TOLERANCES[dtype])
        torch.testing.assert_close(work["states"].double().cpu(), want_states, **TOLERANCES[dtype])
        assert_untouched(case["states"], work["states"], set(src))


REPLAY_ROWS = [  # (dst_slot, num_steps) per row of SRC = [0, 5, 9, 12]
    ([15, 7, 11, -1], [3, 2, 1, 0]),  # fresh slots; the last row skipped
    ([0, 8, 9, 13], [4, 0, 9, 2]),  # in place; a copy (0 steps); steps past T (clamped); another slot
]


@pytest.mark.parametrize("rows", REPLAY_ROWS)
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replay_kernel_matches_reference(dtype, shape, rows, triton_device):
    heads, key_heads, d_k, d_v = shape
    case = make_case(dtype, heads, key_heads, d_k, d_v, device=triton_device)
    dst, steps = (torch.tensor(x, device=triton_device) for x in rows)
    log = [case[n] for n in ("k", "v", "g", "beta")]
    by_kernel, by_ref = case["states"].clone(), case["states"].clone()
    gdn_replay(by_kernel, case["src_slot"], dst, steps, *log)
    gdn_replay_ref(by_ref, case["src_slot"], dst, steps, *log)
    torch.testing.assert_close(by_kernel, by_ref, **TOLERANCES[dtype])
    assert_untouched(case["states"], by_kernel, {d for d in rows[0] if d >= 0})
    for b, (d, n) in enumerate(zip(*rows)):
        if d >= 0 and n == 0:
            assert torch.equal(by_kernel[d], case["states"][SRC[b]])  # no inputs: the source state, copied


def bad_arguments(case):
    """(argument name, replacement, text the error must contain)."""
    return [
        ("snap_slot", case["snap_slot"].int(), "snap_slot"),
        ("src_slot", case["src_slot"][:2], "src_slot"),
        ("q", case["q"][:, :, :1].contiguous(), "q"),
        ("k", case["k"].transpose(2, 3).contiguous().transpose(2, 3), "k is not contiguous"),
        ("k", torch.cat([case["k"]] * 3, dim=2), "key heads"),
        ("v", case["v"][..., :2].contiguous(), "v"),
        ("g", case["g"][:, :, :2].contiguous(), "g"),
        ("beta", case["beta"].int(), "beta"),
        ("num_tokens", case["num_tokens"].float(), "num_tokens"),
        ("states", case["states"][:, :3].contiguous(), "states"),
    ]


@pytest.mark.parametrize("verify", [gdn_verify, gdn_verify_ref])
def test_bad_arguments_raise_before_writing(verify, triton_device):
    case = make_case(torch.float32, device=triton_device)
    for name, bad, message in bad_arguments(case):
        work = clone_case(case)
        work[name] = bad
        before = work["states"].clone()
        with pytest.raises(ValueError, match=message):
            verify(**work)
        assert torch.equal(work["states"], before), name
