"""Log replay: replaying n logged inputs from a snapshot reproduces the snapshot
the verify update wrote after input n - 1, for the kernels and the references."""

import pytest
import torch

from hybridspec.kernels.triton.mamba1_verify import mamba1_verify_ref
from hybridspec.kernels.triton.mamba2_verify import mamba2_verify_ref
from hybridspec.kernels.triton.ssm_replay import mamba1_replay, mamba1_replay_ref, mamba2_replay, mamba2_replay_ref
from slot_plan import TOLERANCES

BATCH, NUM_INPUTS, NUM_SLOTS = 3, 4, 19
SRC = [0, 1, 2]
SNAP = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]  # a snapshot after every input
DST = [15, 16, 17]
SPARE = 18
VERIFY = {"mamba2": mamba2_verify_ref, "mamba1": mamba1_verify_ref}
REPLAYS = {"mamba2": (mamba2_replay, mamba2_replay_ref), "mamba1": (mamba1_replay, mamba1_replay_ref)}


def make_log(family, dtype, device):
    """The state pool and an input log (x, dt, A, B, C) plus D for the verify pass."""
    gen = torch.Generator().manual_seed(2)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)

    if family == "mamba2":
        nheads, headdim, d_state, ngroups = 4, 6, 5, 2
        states = rand(NUM_SLOTS, nheads, headdim, d_state)
        log = dict(
            x=rand(BATCH, NUM_INPUTS, nheads, headdim),
            dt=torch.nn.functional.softplus(rand(BATCH, NUM_INPUTS, nheads)),
            A=-torch.exp(rand(nheads, scale=0.5)),
            B=rand(BATCH, NUM_INPUTS, ngroups, d_state),
            C=rand(BATCH, NUM_INPUTS, ngroups, d_state),
        )
        return states, log, rand(nheads)
    d_inner, d_state = 12, 5
    states = rand(NUM_SLOTS, d_inner, d_state)
    log = dict(
        x=rand(BATCH, NUM_INPUTS, d_inner),
        dt=torch.nn.functional.softplus(rand(BATCH, NUM_INPUTS, d_inner)),
        A=-torch.exp(rand(d_inner, d_state, scale=0.5)),
        B=rand(BATCH, NUM_INPUTS, d_state),
        C=rand(BATCH, NUM_INPUTS, d_state),
    )
    return states, log, rand(d_inner)


def index(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def states_with_snapshots(family, dtype, device):
    """Run the verify reference over the whole log, snapshotting every input."""
    states, log, D = make_log(family, dtype, device)
    VERIFY[family](states, index(SRC, device), index(SNAP, device), D=D,
                   num_tokens=index([NUM_INPUTS] * BATCH, device), **log)
    return states, log


def state_after(states, row, num_steps):
    return states[SRC[row]] if num_steps == 0 else states[SNAP[row][num_steps - 1]]


def assert_untouched(before, after, written):
    for slot in range(before.shape[0]):
        if slot not in written:
            assert torch.equal(before[slot], after[slot]), f"slot {slot} changed"


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("family", ["mamba2", "mamba1"])
def test_replay_equals_verify_snapshot(family, dtype, use_kernel, triton_device):
    replay = REPLAYS[family][0 if use_kernel else 1]
    states, log = states_with_snapshots(family, dtype, triton_device)
    for n in range(NUM_INPUTS + 1):
        steps = [n, (n + 1) % (NUM_INPUTS + 1), (n + 3) % (NUM_INPUTS + 1)]  # rows differ
        work = states.clone()
        replay(work, index(SRC, triton_device), index(DST, triton_device), index(steps, triton_device), **log)
        for row in range(BATCH):
            torch.testing.assert_close(work[DST[row]], state_after(states, row, steps[row]), **TOLERANCES[dtype])
        assert_untouched(states, work, set(DST))


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "ref"])
@pytest.mark.parametrize("family", ["mamba2", "mamba1"])
def test_replay_skips_rows_and_runs_in_place(family, use_kernel, triton_device):
    replay = REPLAYS[family][0 if use_kernel else 1]
    states, log = states_with_snapshots(family, torch.float64, triton_device)
    work = states.clone()
    # Row 0 skipped (dst -1), row 1 in place after 2 inputs, row 2 a copy (0 inputs).
    dst, steps = [-1, SRC[1], SPARE], [3, 2, 0]
    replay(work, index(SRC, triton_device), index(dst, triton_device), index(steps, triton_device), **log)
    torch.testing.assert_close(work[SRC[1]], state_after(states, 1, 2), **TOLERANCES[torch.float64])
    assert torch.equal(work[SPARE], states[SRC[2]])
    assert_untouched(states, work, {SRC[1], SPARE})


@pytest.mark.parametrize("family", ["mamba2", "mamba1"])
def test_bad_arguments_raise_before_writing(family, triton_device):
    states, log, _ = make_log(family, torch.float32, triton_device)
    good = dict(ssm_states=states, src_slot=index(SRC, triton_device), dst_slot=index(DST, triton_device),
                num_steps=index([1, 2, 3], triton_device), **log)
    bad_cases = [
        ("dst_slot", index(SNAP, triton_device), "dst_slot"),
        ("num_steps", good["num_steps"].int(), "num_steps"),
        ("src_slot", good["src_slot"][:2], "src_slot"),
        ("C", log["C"][..., :2].contiguous(), "C"),
        ("x", log["x"].to(torch.int32), "x"),
    ]
    for replay in REPLAYS[family]:
        for name, bad, message in bad_cases:
            before = states.clone()
            with pytest.raises(ValueError, match=message):
                replay(**{**good, name: bad})
            assert torch.equal(states, before)
