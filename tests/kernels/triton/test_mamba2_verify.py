"""Mamba-2 multi-token SSM update: Triton kernel == torch reference == a naive
per-token, per-head loop, for outputs and for every state slot written in place."""

import math

import pytest
import torch

from hybridspec.kernels.triton.mamba2_verify import mamba2_verify, mamba2_verify_ref
from hybridspec.kernels.slot_plan import SlotPlan
from slot_plan import NUM_TOKENS, SNAP, SPANNED, SRC, TOLERANCES, WRITTEN

NUM_SLOTS = 16


def make_case(dtype, device, headdim=6, d_state=5, nheads=4, ngroups=2, src=SRC, snap=SNAP, num_tokens=NUM_TOKENS):
    batch, num_inputs = len(snap), len(snap[0])
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)

    def index(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return dict(
        ssm_states=rand(NUM_SLOTS, nheads, headdim, d_state),
        src_slot=index(src),
        snap_slot=index(snap),
        x=rand(batch, num_inputs, nheads, headdim),
        dt=torch.nn.functional.softplus(rand(batch, num_inputs, nheads)),
        A=-torch.exp(rand(nheads, scale=0.5)),
        B=rand(batch, num_inputs, ngroups, d_state),
        C=rand(batch, num_inputs, ngroups, d_state),
        D=rand(nheads),
        num_tokens=index(num_tokens),
    )


def clone_case(case):
    return {name: value.clone() for name, value in case.items()}


def naive_mamba2(case):
    """Token by token, head by head, in float64: returns (y, states after)."""
    states = case["ssm_states"].double().clone()
    x, dt, B, C = (case[k].double() for k in ("x", "dt", "B", "C"))
    A, D = case["A"].double(), case["D"].double()
    batch, num_inputs, nheads, _ = x.shape
    heads_per_group = nheads // B.shape[2]
    y = torch.zeros_like(x)
    for b in range(batch):
        h = states[int(case["src_slot"][b])].clone()  # [nheads, headdim, d_state]
        for t in range(int(case["num_tokens"][b])):
            for head in range(nheads):
                g = head // heads_per_group
                decay = math.exp(float(dt[b, t, head] * A[head]))
                h[head] = decay * h[head] + dt[b, t, head] * torch.outer(x[b, t, head], B[b, t, g])
                y[b, t, head] = h[head] @ C[b, t, g] + D[head] * x[b, t, head]
            slot = int(case["snap_slot"][b, t])
            if slot >= 0:
                states[slot] = h
    return y, states


def assert_untouched(before, after, written):
    for slot in range(before.shape[0]):
        if slot not in written:
            assert torch.equal(before[slot], after[slot]), f"slot {slot} changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_matches_naive_loop(dtype):
    case = make_case(dtype, "cpu")
    expected_y, expected_states = naive_mamba2(case)
    work = clone_case(case)
    y = mamba2_verify_ref(**work)
    assert y.dtype == dtype and y.shape == case["x"].shape
    torch.testing.assert_close(y.double(), expected_y, **TOLERANCES[dtype])
    torch.testing.assert_close(work["ssm_states"].double(), expected_states, **TOLERANCES[dtype])
    assert_untouched(case["ssm_states"], work["ssm_states"], WRITTEN)
    assert not y[2, 2:].any() and not y[3].any()  # inputs past num_tokens give zeros


@pytest.mark.parametrize("headdim, d_state", [(6, 5), (12, 64)])  # (12, 64): two headdim blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_matches_reference(dtype, headdim, d_state, triton_device):
    case = make_case(dtype, triton_device, headdim=headdim, d_state=d_state)
    by_kernel, by_ref = clone_case(case), clone_case(case)
    y_kernel = mamba2_verify(**by_kernel)
    y_ref = mamba2_verify_ref(**by_ref)
    assert y_kernel.dtype == dtype
    torch.testing.assert_close(y_kernel, y_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(by_kernel["ssm_states"], by_ref["ssm_states"], **TOLERANCES[dtype])
    assert_untouched(case["ssm_states"], by_kernel["ssm_states"], WRITTEN)
    assert not y_kernel[2, 2:].any() and not y_kernel[3].any()
    for name in ("src_slot", "snap_slot", "x", "dt", "A", "B", "C", "D", "num_tokens"):
        assert torch.equal(by_kernel[name], case[name]), f"{name} was modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_decode_updates_head_in_place(dtype, triton_device):
    src = [3, 7, 0]
    case = make_case(dtype, triton_device, src=src, snap=[[s] for s in src], num_tokens=[1, 1, 1])
    expected_y, expected_states = naive_mamba2(case)
    for verify in (mamba2_verify, mamba2_verify_ref):
        work = clone_case(case)
        y = verify(**work)
        torch.testing.assert_close(y.double(), expected_y, **TOLERANCES[dtype])
        torch.testing.assert_close(work["ssm_states"].double(), expected_states, **TOLERANCES[dtype])
        assert_untouched(case["ssm_states"], work["ssm_states"], set(src))


def bad_arguments(case):
    """(argument name, replacement, text the error must contain)."""
    return [
        ("snap_slot", case["snap_slot"].int(), "snap_slot"),
        ("src_slot", case["src_slot"][:2], "src_slot"),
        ("x", case["x"].transpose(2, 3).contiguous().transpose(2, 3), "x is not contiguous"),
        ("dt", case["dt"][:, :, :2], "dt"),
        ("A", case["A"].int(), "A"),
        ("B", case["B"][:, :, :1].expand(-1, -1, 3, -1).contiguous(), "groups"),
        ("C", case["C"][..., :2].contiguous(), "C"),
        ("D", case["D"][None], "D"),
        ("num_tokens", case["num_tokens"].float(), "num_tokens"),
        ("ssm_states", case["ssm_states"][:, :3].contiguous(), "ssm_states"),
    ]


@pytest.mark.parametrize("verify", [mamba2_verify, mamba2_verify_ref])
def test_bad_arguments_raise_before_writing(verify, triton_device):
    case = make_case(torch.float32, triton_device)
    for name, bad, message in bad_arguments(case):
        work = clone_case(case)
        work[name] = bad
        states_before = work["ssm_states"].clone()
        with pytest.raises(ValueError, match=message):
            verify(**work)
        assert torch.equal(work["ssm_states"], states_before)


@pytest.mark.parametrize("layout", sorted(SPANNED))
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_writes_spanned_slots_in_place(dtype, ngroups, layout):
    """Rows whose step-t slots form a span of the pool (aligned rings): the
    reference computes into the span (and reads sources through one) with the
    same y and writes as the naive loop; nothing else is touched."""
    src, snap = SPANNED[layout]
    num_tokens = [len(snap[0])] * len(src)
    case = make_case(dtype, "cpu", ngroups=ngroups, src=src, snap=snap, num_tokens=num_tokens)
    plan = SlotPlan.of_tensors(case["src_slot"], case["snap_slot"], case["num_tokens"])
    assert plan.src_span is not None and all(w.span is not None for w in plan.steps)
    expected_y, expected_states = naive_mamba2(case)
    for inputs in (case, {**case, "snap_slot": case["src_slot"][:, None], "x": case["x"][:, :1].contiguous(),
                          "dt": case["dt"][:, :1].contiguous(), "B": case["B"][:, :1].contiguous(),
                          "C": case["C"][:, :1].contiguous(), "num_tokens": torch.ones_like(case["num_tokens"])}):
        if inputs is not case:  # plain decode in place over the spanned sources
            expected_y, expected_states = naive_mamba2(inputs)
        work = clone_case(inputs)
        y = mamba2_verify_ref(**work)
        torch.testing.assert_close(y.double(), expected_y, **TOLERANCES[dtype])
        torch.testing.assert_close(work["ssm_states"].double(), expected_states, **TOLERANCES[dtype])
        written = {s for row in inputs["snap_slot"].tolist() for s in row}
        assert_untouched(inputs["ssm_states"], work["ssm_states"], written)
