"""Snapshot placement in a ring (`plan_snapshots`) and the restore decision
(`decide`), on their own: plain integers, no model."""
import pytest

from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.checkpoints.restore import decide
from hybridspec.checkpoints.ring import plan_snapshots

RING = [8, 9, 10, 11, 12]  # one sequence's five slots


def test_every_input_gets_its_own_slot_after_the_head():
    plan = plan_snapshots(RING, head=10, snapshot_inputs=[0, 1, 2, 3], num_inputs=4)
    assert plan.snap_slot == [11, 12, 8, 9]  # walks the ring from just after the head, wrapping
    assert plan.survivors == {0: 11, 1: 12, 2: 8, 3: 9}
    assert 10 not in plan.snap_slot  # the head is pinned


def test_sparse_policy_leaves_unsnapshotted_inputs_at_minus_one():
    plan = plan_snapshots(RING, head=8, snapshot_inputs=[0, 2, 4], num_inputs=5)
    assert plan.snap_slot == [9, -1, 10, -1, 11]
    assert plan.survivors == {0: 9, 2: 10, 4: 11}


def test_too_small_a_ring_overwrites_the_oldest_snapshot():
    plan = plan_snapshots([0, 1, 2], head=0, snapshot_inputs=[0, 1, 2, 3], num_inputs=4)
    assert plan.snap_slot == [1, 2, 1, 2]
    assert plan.survivors == {2: 1, 3: 2}  # inputs 0 and 1 were overwritten


def test_ring_halves_keep_rows_at_one_offset_round_after_round():
    """With two slots per snapshot, a round writes the half of the ring the head
    is not in, in input order: rows whose heads start in the same half write the
    same ring offsets every round, whatever each accepts, and never their head."""
    max_seqs, size, gamma = 3, 8, 3  # offset-major rings: ring r holds r, r + 3, r + 6, ...
    rings = [[r + k * max_seqs for k in range(size)] for r in range(max_seqs)]
    heads = [ring[0] for ring in rings]
    for accepted in ([0, 3, 1], [2, 2, 0], [3, 0, 3], [1, 1, 2]):  # the boundary input n of each row, per round
        plans = [plan_snapshots(ring, head, list(range(gamma + 1)), gamma + 1) for ring, head in zip(rings, heads)]
        offsets = [[ring.index(slot) for slot in plan.snap_slot] for ring, plan in zip(rings, plans)]
        assert offsets[0] in ([4, 5, 6, 7], [0, 1, 2, 3]) and offsets.count(offsets[0]) == max_seqs
        assert all(head not in plan.snap_slot for head, plan in zip(heads, plans))
        heads = [decide(plan, n, log_available=True).dst_slot for plan, n in zip(plans, accepted)]


def test_ring_halves_never_write_a_head_past_both_halves():
    ring = list(range(9))  # 9 slots, 4 snapshots: halves are offsets 0-3 and 4-7
    assert plan_snapshots(ring, head=8, snapshot_inputs=[0, 1, 2, 3], num_inputs=4).snap_slot == [0, 1, 2, 3]
    # two snapshots (halves 0-1 and 2-3): a head at offset 2 means offsets 0 and 1
    assert plan_snapshots(ring, head=2, snapshot_inputs=[0, 2], num_inputs=3).snap_slot == [0, -1, 1]
    assert plan_snapshots(ring, head=1, snapshot_inputs=[0, 2], num_inputs=3).snap_slot == [2, -1, 3]


def test_nearest_snapshot_at_or_before():
    plan = plan_snapshots(RING, head=8, snapshot_inputs=[0, 2, 4], num_inputs=5)
    assert plan.nearest_at_or_before(3) == (2, 10)
    assert plan.nearest_at_or_before(0) == (0, 9)
    late = plan_snapshots(RING, head=8, snapshot_inputs=[4], num_inputs=5)
    assert late.nearest_at_or_before(3) == (-1, 8)  # only the round-start head is earlier


def test_a_snapshot_hit_moves_the_head_without_replay():
    plan = plan_snapshots(RING, head=8, snapshot_inputs=[0, 1, 2, 3], num_inputs=4)
    for n in range(4):
        d = decide(plan, n, log_available=True)
        assert (d.path, d.dst_slot, d.num_steps) == ("hit", plan.survivors[n], 0)


@pytest.mark.parametrize("log_available, path", [(True, "log"), (False, "token")])
def test_a_miss_replays_from_the_nearest_earlier_snapshot(log_available, path):
    plan = plan_snapshots(RING, head=8, snapshot_inputs=[0, 2, 4], num_inputs=5)
    d = decide(plan, 3, log_available)
    assert (d.path, d.src_input, d.src_slot, d.dst_slot, d.num_steps) == (path, 2, 10, 10, 1)


def test_a_replay_from_the_head_writes_into_a_snapshot_slot_never_the_head():
    plan = plan_snapshots(RING, head=8, snapshot_inputs=[4], num_inputs=5)  # k = 0
    d = decide(plan, 2, log_available=True)
    assert (d.src_input, d.src_slot, d.num_steps) == (-1, 8, 3)
    assert d.dst_slot != 8 and d.dst_slot in plan.snap_slot


@pytest.mark.parametrize("k, gamma, smallest, halves", [(1, 4, 6, 10), (2, 4, 4, 6), (0, 4, 2, 2), (1, 1, 3, 4)])
def test_default_ring_holds_the_snapshots_or_two_halves_of_them(k, gamma, smallest, halves):
    policy = CheckpointPolicy(snapshot_every=k)
    assert policy.ring_size(gamma) == smallest == len(policy.snapshot_inputs(gamma + 1)) + 1
    assert policy.ring_size(gamma, halves=True) == halves
    assert CheckpointPolicy(snapshot_every=k, ring_slots=3).ring_size(gamma, halves=True) == 3  # explicit wins
