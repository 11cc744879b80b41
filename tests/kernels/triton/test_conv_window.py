"""Conv window: the multi-token causal conv update (kernel == reference == a
naive loop, outputs and every slot) and the rebuild from logged conv inputs."""

import pytest
import torch

from hybridspec.kernels.triton.conv_window import (
    conv_window_rebuild,
    conv_window_rebuild_ref,
    conv_window_update,
    conv_window_update_ref,
)
from slot_plan import NUM_TOKENS, SNAP, SRC, TOLERANCES, WRITTEN

NUM_SLOTS = 19


def index(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def make_case(dtype, device, conv_dim=20, d_conv=4, has_bias=True, activation="silu",
              src=SRC, snap=SNAP, num_tokens=NUM_TOKENS, state_dtype=None):
    batch, num_inputs = len(snap), len(snap[0])
    gen = torch.Generator().manual_seed(3)

    def rand(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)

    return dict(
        conv_states=rand(NUM_SLOTS, conv_dim, d_conv - 1, dtype=state_dtype or dtype),
        src_slot=index(src, device),
        snap_slot=index(snap, device),
        xs=rand(batch, num_inputs, conv_dim),
        weight=rand(conv_dim, d_conv),
        bias=rand(conv_dim) if has_bias else None,
        num_tokens=index(num_tokens, device),
        activation=activation,
    )


def clone_case(case):
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in case.items()}


def naive_conv(case):
    """Token by token in float64, the window as a list of columns: (out, states after)."""
    states = case["conv_states"].double().clone()
    xs, weight = case["xs"].double(), case["weight"].double()
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if case["bias"] is None else case["bias"].double()
    out = torch.zeros_like(xs)
    for b in range(xs.shape[0]):
        src = states[int(case["src_slot"][b])]  # [conv_dim, d_conv - 1]
        window = [src[:, k].clone() for k in range(src.shape[1])]  # oldest first
        for t in range(int(case["num_tokens"][b])):
            inputs = window + [xs[b, t]]  # the d_conv inputs ending at t
            total = bias + sum(weight[:, k] * inputs[k] for k in range(len(inputs)))
            out[b, t] = total * torch.sigmoid(total) if case["activation"] == "silu" else total
            window = inputs[1:]
            slot = int(case["snap_slot"][b, t])
            if slot >= 0:
                states[slot] = torch.stack(window, dim=1)
    return out, states


def assert_untouched(before, after, written):
    for slot in range(before.shape[0]):
        if slot not in written:
            assert torch.equal(before[slot], after[slot]), f"slot {slot} changed"


# ---------------------------------------------------------------------- update


@pytest.mark.parametrize("activation, has_bias", [("silu", True), ("silu", False), (None, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_reference_matches_naive_loop(dtype, activation, has_bias):
    case = make_case(dtype, "cpu", activation=activation, has_bias=has_bias)
    expected_out, expected_states = naive_conv(case)
    work = clone_case(case)
    out = conv_window_update_ref(**work)
    assert out.dtype == dtype and out.shape == case["xs"].shape
    torch.testing.assert_close(out.double(), expected_out, **TOLERANCES[dtype])
    torch.testing.assert_close(work["conv_states"].double(), expected_states, **TOLERANCES[dtype])
    assert_untouched(case["conv_states"], work["conv_states"], WRITTEN)
    assert not out[2, 2:].any() and not out[3].any()  # inputs past num_tokens give zeros


@pytest.mark.parametrize("conv_dim, d_conv, activation, has_bias",
                         [(20, 4, "silu", True), (150, 3, None, False)])  # 150: two channel blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_update_kernel_matches_reference(dtype, conv_dim, d_conv, activation, has_bias, triton_device):
    case = make_case(dtype, triton_device, conv_dim=conv_dim, d_conv=d_conv, activation=activation,
                     has_bias=has_bias)
    by_kernel, by_ref = clone_case(case), clone_case(case)
    out_kernel = conv_window_update(**by_kernel)
    out_ref = conv_window_update_ref(**by_ref)
    assert out_kernel.dtype == dtype
    torch.testing.assert_close(out_kernel, out_ref, **TOLERANCES[dtype])
    assert torch.equal(by_kernel["conv_states"], by_ref["conv_states"])  # windows are copies of inputs
    assert_untouched(case["conv_states"], by_kernel["conv_states"], WRITTEN)
    assert not out_kernel[2, 2:].any() and not out_kernel[3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_decode_updates_window_in_place(dtype, triton_device):
    src = [3, 7, 0]
    case = make_case(dtype, triton_device, src=src, snap=[[s] for s in src], num_tokens=[1, 1, 1])
    expected_out, expected_states = naive_conv(case)
    for update in (conv_window_update, conv_window_update_ref):
        work = clone_case(case)
        out = update(**work)
        torch.testing.assert_close(out.double(), expected_out, **TOLERANCES[dtype])
        torch.testing.assert_close(work["conv_states"].double(), expected_states, **TOLERANCES[dtype])
        assert_untouched(case["conv_states"], work["conv_states"], set(src))


@pytest.mark.parametrize("update", [conv_window_update, conv_window_update_ref])
def test_update_bad_arguments_raise_before_writing(update, triton_device):
    case = make_case(torch.float32, triton_device)
    bad_cases = [
        ("weight", case["weight"][:, None, :], "weight"),  # HF's unsqueezed layout
        ("weight", case["weight"][:, :3].contiguous(), "weight"),
        ("bias", case["bias"][:3], "bias"),
        ("activation", "gelu", "activation"),
        ("xs", case["xs"].transpose(0, 1).contiguous().transpose(0, 1), "xs is not contiguous"),
        ("conv_states", case["conv_states"][..., :2].contiguous(), "conv_states"),
        ("snap_slot", case["snap_slot"][:, :1].contiguous(), "snap_slot"),
        ("num_tokens", case["num_tokens"].int(), "num_tokens"),
    ]
    for name, bad, message in bad_cases:
        work = clone_case(case)
        work[name] = bad
        states_before = work["conv_states"].clone()
        with pytest.raises(ValueError, match=message):
            update(**work)
        assert torch.equal(work["conv_states"], states_before)


# --------------------------------------------------------------------- rebuild

FULL_SRC = [0, 1, 2]
FULL_SNAP = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]  # a window after every input
DST = [15, 16, 17]
SPARE = 18


def states_with_windows(device, state_dtype, xs_dtype):
    case = make_case(xs_dtype, device, src=FULL_SRC, snap=FULL_SNAP, num_tokens=[4, 4, 4], state_dtype=state_dtype)
    conv_window_update_ref(**case)  # writes the windows into case["conv_states"]
    return case["conv_states"], case["xs"]


def window_after(states, row, num_steps):
    return states[FULL_SRC[row]] if num_steps == 0 else states[FULL_SNAP[row][num_steps - 1]]


# (float32, float64): logged inputs rounded into the window. Not float32 into
# bfloat16: the Triton interpreter truncates that cast where a GPU rounds to
# nearest even, so the window could not be compared exactly.
@pytest.mark.parametrize("state_dtype, xs_dtype",
                         [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)])
@pytest.mark.parametrize("rebuild", [conv_window_rebuild, conv_window_rebuild_ref])
def test_rebuild_equals_window_update_wrote(rebuild, state_dtype, xs_dtype, triton_device):
    states, xs = states_with_windows(triton_device, state_dtype, xs_dtype)
    num_inputs = xs.shape[1]
    for n in range(num_inputs + 1):
        steps = [n, (n + 1) % (num_inputs + 1), (n + 3) % (num_inputs + 1)]  # rows differ
        work = states.clone()
        rebuild(work, index(FULL_SRC, triton_device), index(DST, triton_device), index(steps, triton_device), xs)
        for row in range(len(DST)):
            assert torch.equal(work[DST[row]], window_after(states, row, steps[row])), (n, row)
        assert_untouched(states, work, set(DST))


@pytest.mark.parametrize("rebuild", [conv_window_rebuild, conv_window_rebuild_ref])
def test_rebuild_skips_rows_and_runs_in_place(rebuild, triton_device):
    states, xs = states_with_windows(triton_device, torch.float64, torch.float64)
    work = states.clone()
    # Row 0 skipped (dst -1), row 1 in place after 2 inputs, row 2 a copy (0 inputs).
    dst, steps = [-1, FULL_SRC[1], SPARE], [3, 2, 0]
    rebuild(work, index(FULL_SRC, triton_device), index(dst, triton_device), index(steps, triton_device), xs)
    assert torch.equal(work[FULL_SRC[1]], window_after(states, 1, 2))
    assert torch.equal(work[SPARE], states[FULL_SRC[2]])
    assert_untouched(states, work, {FULL_SRC[1], SPARE})


@pytest.mark.parametrize("rebuild", [conv_window_rebuild, conv_window_rebuild_ref])
def test_rebuild_bad_arguments_raise_before_writing(rebuild, triton_device):
    states, xs = states_with_windows(triton_device, torch.float32, torch.float32)
    good = dict(conv_states=states, src_slot=index(FULL_SRC, triton_device), dst_slot=index(DST, triton_device),
                num_steps=index([1, 2, 3], triton_device), xs=xs)
    bad_cases = [
        ("dst_slot", index(FULL_SNAP, triton_device), "dst_slot"),
        ("num_steps", good["num_steps"][:2], "num_steps"),
        ("xs", xs[..., :5].contiguous(), "xs"),
        ("conv_states", states[:, :, :, None], "conv_states"),
        ("conv_states", states[:, :, :0], "d_conv >= 2"),
    ]
    for name, bad, message in bad_cases:
        before = states.clone()
        with pytest.raises(ValueError, match=message):
            rebuild(**{**good, name: bad})
        assert torch.equal(states, before)
