import pytest
import torch

import hybridspec as hs
from hybridspec.cache.state_pool import StatePool
from hybridspec.errors import CacheFullError
from hybridspec.rollback import perturbed_copy, plain_outputs
from hybridspec.cache.state_specs import RecurrentStateShape
from oracles import bamba

# One Mamba2 layer (nheads, headdim, d_state) and one Mamba1 layer (d_inner, d_state).
SHAPES = [RecurrentStateShape((2, 3, 4), (10, 3)), ((6, 4), (6, 2))]


def make_pool(max_seqs=3, ring_slots=4):
    return StatePool(SHAPES, max_seqs=max_seqs, ring_slots=ring_slots, dtype=torch.float32, device="cpu")


def test_storage_is_slot_major_per_layer():
    pool = make_pool()
    assert [tuple(s.shape) for s in pool.ssm_states] == [(12, 2, 3, 4), (12, 6, 4)]
    assert [tuple(c.shape) for c in pool.conv_states] == [(12, 10, 3), (12, 6, 2)]
    assert all(t.is_contiguous() for t in (*pool.ssm_states, *pool.conv_states))


def test_bytes_per_slot_sums_every_layer():
    pool = StatePool(SHAPES, max_seqs=2, ring_slots=2, dtype=torch.float16)
    expected = sum(t[0].numel() * t.element_size() for t in (*pool.ssm_states, *pool.conv_states))
    assert pool.bytes_per_slot == expected == 2 * (24 + 30 + 24 + 12)


def test_rings_are_disjoint_and_head_starts_at_base():
    pool = make_pool()
    base_a, base_b = pool.add_sequence(7), pool.add_sequence(9)
    slots_a, slots_b = pool.ring_slots(7), pool.ring_slots(9)
    # offset-major: offset k of every ring is one block of max_seqs slots
    assert slots_a == [base_a + k * pool.max_seqs for k in range(4)]
    assert slots_b == [base_b + k * pool.max_seqs for k in range(4)] and base_b == base_a + 1
    assert set(slots_a).isdisjoint(slots_b)
    assert pool.head(7) == base_a and pool.head(9) == base_b
    assert pool.num_free_rings == 1 and pool.has_sequence(7) and not pool.has_sequence(8)


def test_add_zeroes_only_the_new_head():
    """A reused ring starts from the zero state in its head; its other slots and
    every other ring keep what they hold (they are written before being read)."""
    pool = make_pool(max_seqs=2, ring_slots=2)
    pool.add_sequence(0)
    pool.add_sequence(1)
    for t in (*pool.ssm_states, *pool.conv_states):
        t.fill_(5.0)
    pool.free_sequence(0)
    head = pool.add_sequence(2)
    assert head == pool.head(2) == pool.ring_slots(2)[0]
    spare, kept = pool.ring_slots(2)[1:], pool.ring_slots(1)
    for t in (*pool.ssm_states, *pool.conv_states):
        assert torch.all(t[head] == 0)
        assert torch.all(t[spare] == 5.0) and torch.all(t[kept] == 5.0)


def test_a_ring_handed_out_the_first_time_is_written_whole():
    """The first admission to a ring writes every slot of it (the pool's fresh pages are
    backed then, not inside the first round's forward); no other ring is touched, and a
    later admission to the same ring writes its head only."""
    pool = make_pool(max_seqs=2, ring_slots=3)
    for t in (*pool.ssm_states, *pool.conv_states):
        t.fill_(5.0)
    pool.add_sequence(0)
    ring, other = pool.ring_slots(0), [s for s in range(6) if s not in pool.ring_slots(0)]
    for t in (*pool.ssm_states, *pool.conv_states):
        assert torch.all(t[ring] == 0) and torch.all(t[other] == 5.0)
        t.fill_(5.0)
    pool.free_sequence(0)
    head = pool.add_sequence(1)
    assert pool.ring_slots(1) == ring
    for t in (*pool.ssm_states, *pool.conv_states):
        assert torch.all(t[head] == 0) and torch.all(t[ring[1:]] == 5.0)


def test_set_head_moves_within_the_ring_only():
    pool = make_pool()
    pool.add_sequence(0)
    pool.add_sequence(1)
    slot = pool.ring_slots(0)[2]
    pool.set_head(0, slot, 5)
    assert pool.head(0) == slot and pool.head_position(0) == 5
    before = pool.snapshot_bookkeeping()
    with pytest.raises(ValueError, match="not in sequence 0's ring"):
        pool.set_head(0, pool.ring_slots(1)[0], 5)
    assert pool.snapshot_bookkeeping() == before


def test_full_pool_raises_before_changing_anything():
    pool = make_pool(max_seqs=2)
    pool.add_sequence(0)
    pool.check_admission(1)
    with pytest.raises(CacheFullError, match=r"2 new sequences .* only 1 of 2 .*max_seqs"):
        pool.check_admission(2)
    pool.add_sequence(1)
    before = pool.snapshot_bookkeeping()
    with pytest.raises(CacheFullError):
        pool.add_sequence(2)
    assert pool.snapshot_bookkeeping() == before


def test_free_returns_the_ring():
    pool = make_pool(max_seqs=1)
    base = pool.add_sequence(0)
    pool.free_sequence(0)
    assert pool.num_free_rings == 1 and not pool.has_sequence(0)
    assert pool.add_sequence(1) == base
    assert pool.snapshot_bookkeeping().rings == {1: 0}


def test_misuse():
    pool = make_pool()
    pool.add_sequence(0)
    with pytest.raises(ValueError, match="already owns"):
        pool.add_sequence(0)
    for call in (lambda: pool.head(5), lambda: pool.ring_slots(5), lambda: pool.free_sequence(5),
                 lambda: pool.set_head(5, 0, 0)):
        with pytest.raises(KeyError, match="add_sequence"):
            call()
    with pytest.raises(ValueError, match="ring_slots=0"):
        StatePool(SHAPES, max_seqs=1, ring_slots=0)
    with pytest.raises(ValueError, match="max_seqs=0"):
        StatePool(SHAPES, max_seqs=0, ring_slots=1)
    with pytest.raises(ValueError, match=r"conv state shape \(4, 0\)"):
        StatePool([((2, 2), (4, 0))], max_seqs=1, ring_slots=1)


def test_pool_without_mamba_layers_still_counts_rings():
    pool = StatePool([], max_seqs=1, ring_slots=2)
    assert pool.bytes_per_slot == 0
    pool.add_sequence(0)
    with pytest.raises(CacheFullError):
        pool.add_sequence(1)


@pytest.mark.parametrize("policy", [hs.CheckpointPolicy(snapshot_every=1, log_inputs=False),
                                    hs.CheckpointPolicy(snapshot_every=2, log_inputs=True),
                                    hs.CheckpointPolicy(snapshot_every=0, log_inputs=False)])
def test_no_ring_slot_but_the_head_is_read_before_it_is_written(policy):
    """Every state slot of the target's and the drafter's pools NaN before
    speculative decoding (only the heads are zeroed when a sequence comes in):
    a slot read before a round wrote it would put NaN in the logits; the
    tokens are plain decoding's, and a second batch on the same engine (reused
    rings, stale snapshots) gives them again."""
    target = hs.from_hf(bamba(seed=0))
    engine = hs.Engine(target, draft=perturbed_copy(target, scale=0.03, seed=1), num_draft_tokens=3,
                       checkpoint=policy, max_batch_size=3)
    for pool in (engine.cache.states, engine.speculator.drafter.cache.states):
        for t in (*pool.ssm_states, *pool.conv_states):
            t.fill_(float("nan"))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    params = hs.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain_outputs(target, prompts, params)]
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(prompts, params)] == want



def test_head_offset_and_slot_at_agree_with_the_ring():
    pool = make_pool()
    for seq in (7, 9, 4):
        pool.add_sequence(seq)
    pool.move_head(9, pool.ring_slots(9)[2])
    pool.move_head(4, pool.ring_slots(4)[3])
    for seq in (7, 9, 4):
        ring = pool.ring_slots(seq)
        assert pool.head_offset(seq) == ring.index(pool.head(seq))
        assert [pool.slot_at(seq, k) for k in range(len(ring))] == ring
    assert [pool.head_offset(s) for s in (7, 9, 4)] == [0, 2, 3]
