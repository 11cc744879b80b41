"""Ring halves keep a batch's snapshot slots in one span: `HybridCache.align_heads`
moves a row whose head sits in the other half (a copy, same state and position),
and the engine runs rows in ring order."""
from __future__ import annotations

from types import SimpleNamespace

import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.checkpoints.checkpointer import Checkpointer
from hybridspec.kernels.slot_plan import SlotPlan
from hybridspec.spec.round import RoundBatch
from oracles import bamba

GAMMA = 4


def test_a_row_in_the_other_half_is_moved_and_the_round_writes_one_grid():
    target = hs.from_hf(bamba(seed=5))
    cache = HybridCache(target.config, max_seqs=3, num_blocks=8, block_size=16, ring_slots=2 * (GAMMA + 1),
                        dtype=target.dtype)
    ids = [0, 1, 2]
    target.prefill(cache, ids, [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]], last_only=True)
    states = cache.states
    ring = states.ring_slots(1)
    moved_from = ring[GAMMA + 2]  # row 1's head in the high half, as after a round the others have not had
    states.move_head(1, moved_from)
    state_before = [s[moved_from].clone() for s in (*states.ssm_states, *states.conv_states)]
    position = states.head_position(1)
    requests = [SimpleNamespace(last_token=7) for _ in ids]
    round = RoundBatch(requests, ids, [cache.computed_len[s] - 1 for s in ids], [cache.head(s) for s in ids])
    round.drafts = [[1, 2, 3, 4]] * 3
    Checkpointer(target, cache).plan(round, hs.CheckpointPolicy())
    halves = {states.ring_slots(s).index(h) < GAMMA + 1 for s, h in zip(ids, round.start_heads)}
    assert halves == {True}  # every head in the low half now: the majority's
    head = cache.head(1)
    assert head == round.start_heads[1] != moved_from and states.head_position(1) == position
    for before, pool in zip(state_before, (*states.ssm_states, *states.conv_states)):
        assert torch.equal(pool[head], before)
    offsets = [[states.ring_slots(s).index(slot) for slot in row] for s, row in zip(ids, round.snap_slot)]
    assert offsets == [list(range(GAMMA + 1, 2 * GAMMA + 2))] * 3
    plan = SlotPlan.of_lists(round.start_heads, round.snap_slot, [GAMMA + 1] * 3, "cpu")
    assert plan.snapshot_grid is not None and plan.src_span is not None


def test_rings_are_reused_lowest_first():
    from hybridspec.cache.state_pool import StatePool
    pool = StatePool([((2, 3, 4), (10, 3))], max_seqs=4, ring_slots=2)
    for s in range(4):
        pool.add_sequence(s)
    pool.free_sequence(2)
    pool.free_sequence(0)
    pool.add_sequence(9)
    assert pool.ring_index(9) == 0  # not 2, freed first: the running rings stay 0, 1, 3 and then 0 … 3
    pool.add_sequence(8)
    assert sorted(pool.ring_index(s) for s in (9, 1, 8, 3)) == [0, 1, 2, 3]


def test_plain_heads_move_to_the_common_offset_with_their_state():
    target = hs.from_hf(bamba(seed=6))
    cache = HybridCache(target.config, max_seqs=3, num_blocks=8, block_size=16, ring_slots=2, dtype=target.dtype)
    ids = [0, 1, 2]
    target.prefill(cache, ids, [[3, 1, 4], [1, 5, 9], [2, 6, 5]], last_only=True)
    target.decode(cache, [1], [7])  # row 1 alone: its head moves to the other offset
    states = cache.states
    offsets = [states.ring_slots(s).index(cache.head(s)) for s in ids]
    assert offsets[0] == offsets[2] != offsets[1]
    before = [pool[cache.head(1)].clone() for pool in (*states.ssm_states, *states.conv_states)]
    position = states.head_position(1)
    cache.align_heads(ids)
    assert [states.ring_slots(s).index(cache.head(s)) for s in ids] == [offsets[0]] * 3
    assert states.head_position(1) == position
    for want, pool in zip(before, (*states.ssm_states, *states.conv_states)):
        assert torch.equal(pool[cache.head(1)], want)
    plan = cache.plan_forward(ids, [1, 1, 1], None)
    assert plan.batch.slots.src_span is not None and plan.batch.slots.steps[0].span is not None
    cache.abort_forward(plan)


def test_plain_steps_of_a_target_cache_take_turns_between_two_ring_offsets():
    """spare="pair" (the Engine's target cache): plain steps write the head's partner
    at offset XOR 1, so a large ring's states stay in two offsets; "next" (a model
    drafter's cache, which keeps its chain of drafts) cycles through the ring.
    Both give the same logits."""
    from hybridspec.rollback.models import tiny_model
    model = tiny_model(3)
    caches = {spare: HybridCache(model.config, max_seqs=2, num_blocks=8, block_size=8, ring_slots=5,
                                 dtype=model.dtype, spare=spare) for spare in ("next", "pair")}
    offsets, logits = {spare: [] for spare in caches}, {spare: [] for spare in caches}
    for spare, cache in caches.items():
        model.prefill(cache, [0, 1], [[3, 1, 4], [1, 5, 9]], last_only=True)
        for token in (2, 6, 5, 3, 5, 8):
            logits[spare].append(model.decode(cache, [0, 1], [token, token + 1]))
            offsets[spare].append(cache.states.ring_slots(1).index(cache.head(1)))
    assert offsets["next"] == [2, 3, 4, 0, 1, 2]  # prefill wrote offset 1
    assert offsets["pair"] == [0, 1, 0, 1, 0, 1]
    for a, b in zip(logits["next"], logits["pair"]):
        assert torch.equal(a, b)
    odd = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=8, ring_slots=3, dtype=model.dtype,
                      spare="pair")
    odd.add_sequences([0])
    ring = odd.states.ring_slots(0)
    odd.states.set_head(0, ring[2], 0)
    assert odd.spare_slot(0) == ring[0]  # the last offset of an odd ring has no partner: the next slot
    assert hs.Engine(model, draft=hs.NgramDrafter()).cache.spare == "pair"
