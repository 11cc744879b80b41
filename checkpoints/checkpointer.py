"""`Checkpointer`: the one owner of a target's recurrent state across
speculative rounds. The round speaks three verbs to it:

- `plan(round, policy)`: where each row's verify forward writes snapshots
  (`round.plans`, `round.snap_slot` [batch, G + 1]; heads aligned first,
  `HybridCache.align_heads`) and, when the policy logs and some boundary may find no
  snapshot, the input log to fill (`round.input_log`);
- `commit(round)`: for each live row, the cheapest restore of the state after
  verify input n (snapshot hit, log replay, token replay: `round.decisions`),
  then every layer of the row moved to its boundary (`HybridCache.commit`);
- `revert(round)`: every row back to where the round began (its pinned head
  was never written; `HybridCache.rewind_to`).

A tree round (`spec.tree`) plans a snapshot slot for every input of a row
whose ring holds one per input beside the pinned head (`plan_tree`). Where
the whole C forward takes the tree it writes every input's state there, and
`commit_tree` moves the ring head to the accepted input's slot; elsewhere the
torch forms keep every input's state in the `TreeBatch` and `commit_tree`
copies the accepted input's into a ring slot other than the head. Either way
it moves the K/V of the accepted inputs onto the sequence's next positions.
It reaches the model only through `model.recurrent_layers` (`RecurrentLayer`)
and its `extend` (token replay).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.checkpoints.restore import RestoreDecision, decide, log_replay, token_replay
from hybridspec.checkpoints.ring import plan_snapshots
from hybridspec.errors import ConfigError

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
        # under ring halves, every head in the half most rows' heads are in: one span per input
        round.start_heads = self.cache.align_heads(round.seq_ids, [len(inputs) for inputs in snapshots])
        for b, (s, head, inputs) in enumerate(zip(round.seq_ids, round.start_heads, snapshots)):
            plan = plan_snapshots(self.cache.states.ring_slots(s), head, inputs, T)
            round.plans[b] = plan
            round.snap_slot[b] = list(plan.snap_slot)
        # a log only where some boundary of some row may find no snapshot (every input
        # snapshotted, with a ring large enough: every boundary is a hit)
        if policy.log_inputs and any(len(plan.survivors) < len(inputs)
                                     for plan, inputs in zip(round.plans, round.verify_inputs)):
            round.input_log = {}

    def plan_tree(self, round: RoundBatch) -> None:
        """A tree round's forward (its `round.tree` made): a snapshot slot per input of each
        row whose ring has one per input beside the head (`round.snap_slot`; -1s elsewhere,
        None without recurrent state), no log; hidden states a drafter reads stay pending until
        the round lays out the accepted path's (`HiddenStates.follow_path`)."""
        if self.has_state and self.cache.ring_slots < 2:
            raise ConfigError(f"tree drafts need at least 2 ring slots in the target's cache, it has "
                              f"{self.cache.ring_slots}; no state was changed")
        round.snap_slot, round.plans, round.input_log = None, [None] * len(round.seq_ids), None
        if self.has_state:
            T = round.num_inputs
            round.snap_slot = [self._tree_slots(seq, head, len(inputs), T)
                               for seq, head, inputs in zip(round.seq_ids, round.start_heads, round.verify_inputs)]

    def _tree_slots(self, seq: int, head: int, n: int, T: int) -> list[int]:
        """[T] the ring slot of each of a row's n tree inputs (none twice, never the head), or -1s
        where its ring has fewer than n + 1 slots."""
        ring = self.cache.states.ring_slots(seq)
        if len(ring) < n + 1:
            return [-1] * T
        return plan_snapshots(ring, head, list(range(n)), T).snap_slot

    def commit_tree(self, round: RoundBatch) -> None:
        """Each live row at its boundary: its ring head at the accepted input's slot (or that
        input's states copied into a ring slot other than the pinned head, from the
        `TreeBatch`), the accepted inputs' K/V onto positions start .. start + n."""
        round.decisions = [None] * len(round.seq_ids)
        for b in round.live:
            seq, start, path = round.seq_ids[b], round.start_lens[b], round.paths[b]
            head = -1
            if self.has_state and round.tree.in_ring:  # the forward wrote every input's state to its slot
                head = round.snap_slot[b][path[-1]]
            elif self.has_state:
                head = next(s for s in self.cache.states.ring_slots(seq) if s != round.start_heads[b])
                round.tree.write_input(self.cache.states.ssm_states, self.cache.states.conv_states, b, path[-1], head)
            if self.cache.kv is not None:
                moved = [k for k, t in enumerate(path) if t != k]
                self.cache.kv.move_positions(seq, [start + path[k] for k in moved], [start + k for k in moved])
            self.cache.commit(seq, round.boundary(b), head)

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
                self.cache.rewind_to(s, length, head)

    def held_bytes(self, round: RoundBatch) -> int:
        """Checkpoint bytes the round held: surviving snapshots plus the input log."""
        slot_bytes = self.cache.states.bytes_per_slot if self.has_state else 0
        held = sum(len(p.survivors) * slot_bytes for p in round.plans if p is not None)
        if round.tree is not None:  # every input's state: in its ring slot, or kept beside the ring
            in_ring = round.tree.in_ring and round.snap_slot is not None
            held += (sum(slot >= 0 for row in round.snap_slot for slot in row) * slot_bytes if in_ring
                     else round.tree.nbytes())
        return held + sum(log.nbytes() for log in (round.input_log or {}).values())
