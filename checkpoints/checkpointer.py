"""`Checkpointer`: the one owner of a target's recurrent state across
speculative rounds. The round speaks three verbs to it:

- `plan(round, policy)`: where each row's verify forward writes snapshots
  (`round.plans`, `round.snap_slot` [batch, G + 1]; heads aligned first,
  `align_heads`) and, when the policy logs and some boundary may find no
  snapshot, the input log to fill (`round.input_log`);
- `commit(round)`: for each live row, the cheapest restore of the state after
  verify input n (snapshot hit, log replay, token replay: `round.decisions`),
  then every layer of the row moved to its boundary;
- `revert(round)`: every row back to where the round began (its pinned head
  was never written).
It reaches the model only through `model.recurrent_layers` (`RecurrentLayer`)
and its `extend` (token replay).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.checkpoints.restore import RestoreDecision, decide, log_replay, token_replay
from hybridspec.checkpoints.ring import head_half, plan_snapshots

if TYPE_CHECKING:
    from hybridspec.spec.round import RoundBatch


class Checkpointer:
    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.has_state = cache.states is not None

    def plan(self, round: RoundBatch, policy: CheckpointPolicy) -> None:
        """Fill `round.plans`, `round.snap_slot` and `round.input_log` for the verify forward."""
        T = round.num_inputs
        round.snap_slot = [[-1] * T for _ in round.seq_ids]
        round.plans = [None] * len(round.seq_ids)
        round.input_log = None
        if not self.has_state:
            return
        snapshots = [policy.snapshot_inputs(len(inputs)) for inputs in round.verify_inputs]
        self.align_heads(round, [len(inputs) for inputs in snapshots])
        for b, (s, head, inputs) in enumerate(zip(round.seq_ids, round.start_heads, snapshots)):
            plan = plan_snapshots(self.cache.states.ring_slots(s), head, inputs, T)
            round.plans[b] = plan
            round.snap_slot[b] = list(plan.snap_slot)
        # a log only where some boundary of some row may find no snapshot (every input
        # snapshotted, with a ring large enough: every boundary is a hit)
        if policy.log_inputs and any(len(plan.survivors) < len(inputs)
                                     for plan, inputs in zip(round.plans, round.verify_inputs)):
            round.input_log = {}

    def align_heads(self, round: RoundBatch, counts: list[int]) -> None:
        """Under ring halves, put every row's head in the half most rows' heads
        are in (`head_half`), so that the round writes the same ring offsets in
        every row (one span per input: the recurrence runs in place). A row on
        the other side has its head state copied once into its ring slot at the
        majority's most common head offset, and that slot becomes its head
        (same position); `round.start_heads` follows. The round never writes a
        head (`plan_snapshots`), so the copy is safe whatever each row's count."""
        states = self.cache.states
        rings = [states.ring_slots(s) for s in round.seq_ids]
        halves = [head_half(ring, head, count) for ring, head, count in zip(rings, round.start_heads, counts)]
        known = [h for h in halves if h is not None]
        if len(set(known)) < 2:
            return
        majority = max(("low", "high"), key=known.count)
        offsets = [ring.index(head) for ring, head, half in zip(rings, round.start_heads, halves) if half == majority]
        offset = max(set(offsets), key=offsets.count)  # the majority's most common head offset: sources in one span
        for b, (s, ring, half) in enumerate(zip(round.seq_ids, rings, halves)):
            if half is None or half == majority:
                continue
            states.move_head(s, ring[offset])
            round.start_heads[b] = ring[offset]

    def commit(self, round: RoundBatch) -> list[RestoreDecision | None]:
        """Restore each live row's state at its boundary and move every layer there."""
        log_available = round.input_log is not None
        live = set(round.live)
        decisions = [decide(plan, n, log_available) if b in live and plan is not None else None
                     for b, (plan, n) in enumerate(zip(round.plans, round.accepted))]
        round.decisions = decisions
        if self.has_state:
            if log_available:
                log_replay(self.model, self.cache, decisions, round.input_log)
            token_replay(self.model, self.cache, round.seq_ids, decisions, round.verify_inputs, round.start_lens)
        for b in round.live:
            head = decisions[b].dst_slot if decisions[b] is not None else -1
            self.cache.commit(round.seq_ids[b], round.boundary(b), head)
        return decisions

    def revert(self, round: RoundBatch) -> None:
        """Every row of the round back to its round-start length and head."""
        for s, length, head in zip(round.seq_ids, round.start_lens, round.start_heads):
            if self.cache.has_sequence(s):
                self.cache.commit(s, length, head)

    def held_bytes(self, round: RoundBatch) -> int:
        """Checkpoint bytes the round held: surviving snapshots plus the input log."""
        slot_bytes = self.cache.states.bytes_per_slot if self.has_state else 0
        held = sum(len(p.survivors) * slot_bytes for p in round.plans if p is not None)
        return held + sum(log.nbytes() for log in (round.input_log or {}).values())
