"""Mamba-1 (Jamba) multi-token selective-scan update: Triton kernel == torch
reference == a naive per-token, per-channel loop, for outputs and every slot."""

import pytest
import torch

from hybridspec.kernels.triton.mamba1_verify import mamba1_verify, mamba1_verify_ref
from hybridspec.kernels.slot_plan import SlotPlan
from slot_plan import NUM_TOKENS, SNAP, SPANNED, SRC, TOLERANCES, WRITTEN

NUM_SLOTS = 16


def make_case(dtype, device, d_inner=12, d_state=5, src=SRC, snap=SNAP, num_tokens=NUM_TOKENS):
    batch, num_inputs = len(snap), len(snap[0])
    gen = torch.Generator().manual_seed(1)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)

    def index(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return dict(
        ssm_states=rand(NUM_SLOTS, d_inner, d_state),
        src_slot=index(src),
        snap_slot=index(snap),
        x=rand(batch, num_inputs, d_inner),
        dt=torch.nn.functional.softplus(rand(batch, num_inputs, d_inner)),
        A=-torch.exp(rand(d_inner, d_state, scale=0.5)),
        B=rand(batch, num_inputs, d_state),
        C=rand(batch, num_inputs, d_state),
        D=rand(d_inner),
        num_tokens=index(num_tokens),
    )


def clone_case(case):
    return {name: value.clone() for name, value in case.items()}


def naive_mamba1(case):
    """Token by token, channel by channel, in float64: returns (y, states after)."""
    states = case["ssm_states"].double().clone()
    x, dt, A, B, C, D = (case[k].double() for k in ("x", "dt", "A", "B", "C", "D"))
    batch, _, d_inner = x.shape
    y = torch.zeros_like(x)
    for b in range(batch):
        h = states[int(case["src_slot"][b])].clone()  # [d_inner, d_state]
        for t in range(int(case["num_tokens"][b])):
            for d in range(d_inner):
                h[d] = torch.exp(dt[b, t, d] * A[d]) * h[d] + dt[b, t, d] * x[b, t, d] * B[b, t]
                y[b, t, d] = torch.dot(h[d], C[b, t]) + D[d] * x[b, t, d]
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
    expected_y, expected_states = naive_mamba1(case)
    work = clone_case(case)
    y = mamba1_verify_ref(**work)
    assert y.dtype == dtype and y.shape == case["x"].shape
    torch.testing.assert_close(y.double(), expected_y, **TOLERANCES[dtype])
    torch.testing.assert_close(work["ssm_states"].double(), expected_states, **TOLERANCES[dtype])
    assert_untouched(case["ssm_states"], work["ssm_states"], WRITTEN)
    assert not y[2, 2:].any() and not y[3].any()  # inputs past num_tokens give zeros


@pytest.mark.parametrize("d_inner, d_state", [(12, 5), (40, 64)])  # (40, 64): five channel blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_matches_reference(dtype, d_inner, d_state, triton_device):
    case = make_case(dtype, triton_device, d_inner=d_inner, d_state=d_state)
    by_kernel, by_ref = clone_case(case), clone_case(case)
    y_kernel = mamba1_verify(**by_kernel)
    y_ref = mamba1_verify_ref(**by_ref)
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
    expected_y, expected_states = naive_mamba1(case)
    for verify in (mamba1_verify, mamba1_verify_ref):
        work = clone_case(case)
        y = verify(**work)
        torch.testing.assert_close(y.double(), expected_y, **TOLERANCES[dtype])
        torch.testing.assert_close(work["ssm_states"].double(), expected_states, **TOLERANCES[dtype])
        assert_untouched(case["ssm_states"], work["ssm_states"], set(src))


def bad_arguments(case):
    """(argument name, replacement, text the error must contain)."""
    return [
        ("snap_slot", case["snap_slot"][:, :2].contiguous(), "snap_slot"),
        ("src_slot", case["src_slot"].int(), "src_slot"),
        ("x", case["x"].transpose(1, 2).contiguous().transpose(1, 2), "x is not contiguous"),
        ("dt", case["dt"][..., :3].contiguous(), "dt"),
        ("A", case["A"][0], "A"),
        ("B", case["B"][..., :2].contiguous(), "B"),
        ("C", case["C"].int(), "C"),
        ("D", case["D"][:3], "D"),
        ("num_tokens", case["num_tokens"][:1], "num_tokens"),
        ("ssm_states", case["ssm_states"][:, :3].contiguous(), "ssm_states"),
    ]


@pytest.mark.parametrize("verify", [mamba1_verify, mamba1_verify_ref])
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_writes_spanned_slots_in_place(dtype, layout):
    """Step-t slots that form a span of the pool (aligned rings) are computed
    into in place, with the naive loop's y and writes; nothing else is touched."""
    src, snap = SPANNED[layout]
    case = make_case(dtype, "cpu", src=src, snap=snap, num_tokens=[len(snap[0])] * len(src))
    plan = SlotPlan.of_tensors(case["src_slot"], case["snap_slot"], case["num_tokens"])
    assert plan.src_span is not None and all(w.span is not None for w in plan.steps)
    expected_y, expected_states = naive_mamba1(case)
    work = clone_case(case)
    y = mamba1_verify_ref(**work)
    torch.testing.assert_close(y.double(), expected_y, **TOLERANCES[dtype])
    torch.testing.assert_close(work["ssm_states"].double(), expected_states, **TOLERANCES[dtype])
    assert_untouched(case["ssm_states"], work["ssm_states"], {s for row in snap for s in row})
