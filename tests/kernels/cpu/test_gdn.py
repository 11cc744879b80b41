"""The gated delta rule in C (`kernels/cpu/gdn.c`) against the torch
references it stands in for: the same outputs and snapshot writes as
`gdn_verify_ref` within float32 rounding, for decode and multi-input
forwards, key heads shared by value heads, steps without a snapshot, padded
rows (zeros out, nothing written after a row's last live input, even where
its plan names a slot), in-place decode; every other slot untouched (the same bits at every
thread count: tests/kernels/cpu/test_threads.py); its log replay (`cpu_gdn.gdn_replay`) against
`gdn_replay_ref` and, bit for bit, against the forward's snapshots; and the
backend op taking it only where it applies."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridspec.kernels import ops
from hybridspec.kernels.cpu import gdn as cpu_gdn
from hybridspec.kernels.triton.gdn_verify import gdn_replay_ref, gdn_verify_ref
from hybridspec.kernels.slot_plan import SlotPlan
from native_cpu import one_thread, x86_with_compiler  # noqa: F401 (one_thread: an autouse fixture)
from test_state_kernels import lengths

pytestmark = x86_with_compiler
TOL = dict(rtol=1e-5, atol=1e-5)

CASES = [  # batch, T, HV, HK, d_k, d_v
    (1, 1, 4, 4, 128, 128),  # a Qwen3.5 head size, decode
    (1, 5, 4, 2, 128, 128),  # verify of γ = 4, two value heads per key head
    (3, 4, 4, 2, 16, 40),  # d_v: a block of 32 columns and one of 8
    (2, 3, 6, 3, 8, 24),  # one block of 3 vectors
    (4, 1, 2, 1, 5, 16),  # odd d_k; both value heads on one key head
]


def inputs(batch, T, heads, key_heads, d_k, d_v, seed=0):
    """(pool, src, snap, (q, k, v, g, beta)): each row's ring after its source slot,
    a snapshot after every other input and after the last."""
    gen = torch.Generator().manual_seed(seed)
    per_row = T + 3
    pool = torch.randn(batch * per_row, heads, d_k, d_v, generator=gen)
    src = [b * per_row for b in range(batch)]
    snap = [[b * per_row + 1 + t if t % 2 == 0 or t == T - 1 else -1 for t in range(T)] for b in range(batch)]
    q, k = (torch.nn.functional.normalize(torch.randn(batch, T, key_heads, d_k, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, T, heads, d_v, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(batch, T, heads, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, T, heads, generator=gen))
    return pool, src, snap, (q * d_k ** -0.5, k, v, g, beta)


def assert_untouched(before, after, written):
    untouched = [s for s in range(before.shape[0]) if s not in written]
    assert torch.equal(after[untouched], before[untouched])  # sources and unplanned slots kept


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_same_outputs_and_snapshot_writes_as_the_reference(case, padded):
    batch, T = case[:2]
    pool, src, snap, args = inputs(*case)
    ref_pool, native_pool = pool.clone(), pool.clone()
    live = lengths(batch, T, padded)
    want = gdn_verify_ref(ref_pool, None, None, *args, None, plan=SlotPlan(src, snap, live, "cpu"))
    plan = SlotPlan(src, snap, live, "cpu")
    assert cpu_gdn.applies(native_pool, args[2], plan)
    got = cpu_gdn.gdn_steps(native_pool, plan, *args)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(native_pool, ref_pool, **TOL)
    assert_untouched(pool, native_pool, {s for row, n in zip(snap, live) for s in row[:n] if s >= 0})
    if padded:
        assert not got[~plan.is_live].any()  # padding inputs give zeros


# tests/kernels/triton/slot_plan.py's plan: row 1 ends in place (snap == src), row 2 stops after 2 inputs (slot 8
# stays untouched), row 3 consumes nothing
SRC, SNAP, NUM_TOKENS = [0, 5, 9, 12], [[1, 2, 3, 4], [-1, 6, -1, 5], [10, 11, -1, 8], [13, -1, 14, -1]], [4, 4, 2, 0]
WRITTEN = {1, 2, 3, 4, 5, 6, 10, 11}


def test_the_shared_slot_plan_and_in_place_decode():
    """The kernel tests' plan (a row ending in place, one stopping early with a
    slot planned after its end, one with no inputs), then plain decode writing
    each row's state back into its source slot."""
    pool, _, _, args = inputs(len(SRC), len(SNAP[0]), 4, 2, 6, 8, seed=1)
    pool = torch.randn(16, *pool.shape[1:])
    for src, snap, live, written in ((SRC, SNAP, NUM_TOKENS, WRITTEN),
                                     (SRC, [[s] for s in SRC], [1] * len(SRC), set(SRC))):
        step_args = [x[:, :len(snap[0])].contiguous() for x in args]
        ref_pool, native_pool = pool.clone(), pool.clone()
        want = gdn_verify_ref(ref_pool, None, None, *step_args, None, plan=SlotPlan(src, snap, live, "cpu"))
        got = cpu_gdn.gdn_steps(native_pool, SlotPlan(src, snap, live, "cpu"), *step_args)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(native_pool, ref_pool, **TOL)
        assert_untouched(pool, native_pool, written)


REPLAYS = [  # dst, num_steps per row (sources: each row's ring start)
    ([1, -1, 9], [3, 2, 1]),  # a row skipped
    ([0, 7, 13], [4, 0, 9]),  # in place; a copy (0 steps); steps past T (clamped)
    ([2, 8, 12], [1, 2, 2]),  # every row
]


@pytest.mark.parametrize("rows", REPLAYS)
def test_replay_matches_the_reference_and_the_forwards_snapshots(rows):
    case = (3, 4, 4, 2, 16, 40)
    pool, src, _, (q, k, v, g, beta) = inputs(*case, seed=4)
    src_slot, dst_slot, num_steps = (torch.tensor(x) for x in (src, *rows))
    by_native, by_ref = pool.clone(), pool.clone()
    cpu_gdn.gdn_replay(by_native, src_slot, dst_slot, num_steps, k, v, g, beta)
    gdn_replay_ref(by_ref, src_slot, dst_slot, num_steps, k, v, g, beta)
    torch.testing.assert_close(by_native, by_ref, **TOL)
    assert_untouched(pool, by_native, {d for d in rows[0] if d >= 0})
    # the forward snapshotting every input: the replayed state is its snapshot after input n - 1, bit for bit
    T = case[1]
    forward = torch.cat([pool, torch.zeros(len(src) * T, *pool.shape[1:])])
    snap = [[len(pool) + b * T + t for t in range(T)] for b in range(len(src))]
    cpu_gdn.gdn_steps(forward, SlotPlan(src, snap, [T] * len(src), "cpu"), q, k, v, g, beta)
    for b, (d, n) in enumerate(zip(*rows)):
        if d >= 0:
            want = forward[snap[b][min(n, T) - 1]] if n > 0 else pool[src[b]]
            assert torch.equal(by_native[d], want), b


def test_the_backend_op_takes_the_c_loop_only_where_it_applies(monkeypatch):
    """Native: the C loop wherever it applies, a prefill's final-state-only forward included
    (rather than the chunked form); elsewhere the torch form."""
    pool, src, snap, args = inputs(2, 3, 4, 2, 16, 12)  # d_v 12: not a multiple of 8
    batch = SimpleNamespace(slots=SlotPlan(src, snap, [3, 3], "cpu"), final_state_only=False)
    assert not cpu_gdn.applies(pool, args[2], batch.slots)
    assert not cpu_gdn.applies(pool.double(), args[2].double(), batch.slots)
    calls = []
    monkeypatch.setattr(cpu_gdn, "gdn_steps", lambda *a: calls.append(a) or "native")
    native = ops.GDN_STEPS["native"]
    ref_pool = pool.clone()
    torch.testing.assert_close(native(pool, batch, *args, final_scan=None),
                               gdn_verify_ref(ref_pool, None, None, *args, None, plan=batch.slots))
    assert not calls and torch.equal(pool, ref_pool)
    pool, src, snap, args = inputs(2, 3, 4, 2, 16, 16)
    batch.slots = SlotPlan(src, snap, [3, 3], "cpu")
    assert native(pool, batch, *args, final_scan=None) == "native" and len(calls) == 1
    pool, src, snap, args = inputs(1, 16, 4, 2, 16, 16)  # a prefill of 16 inputs, final state only
    batch = SimpleNamespace(slots=SlotPlan(src, snap, [16], "cpu"), final_state_only=True)
    assert native(pool, batch, *args, final_scan=None) == "native" and len(calls) == 2
    assert ops.GDN_STEPS["torch"](pool, batch, *args, final_scan=lambda *a: "chunked") == "chunked"
