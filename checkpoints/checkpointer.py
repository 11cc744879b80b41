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

A tree round (`spec.tree`) follows the round's policy too (`tree_restore`):
`plan_tree` gives a snapshot slot to every input of a row whose ring holds one
per input beside the pinned head under a policy that snapshots every input,
else to the inputs the policy selects that the ring holds, and asks for the
input log when the policy logs and some input has no slot; the forward
writes those snapshots (the whole C forward or the `TreeBatch`) and keeps no
other input's state. `commit_tree` moves the K/V of the accepted inputs onto
the sequence's next positions, then restores the accepted input's state as a
chain's boundary along the accepted path: a head move where it has a
snapshot, else a log (or token) replay of the path from its nearest
snapshotted ancestor.
It reaches the model only through `model.recurrent_layers` (`RecurrentLayer`)
and its `extend` (token replay).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.checkpoints.restore import RestoreDecision, decide, log_replay, token_replay
from hybridspec.checkpoints.ring import plan_snapshots
from hybridspec.checkpoints.tree_restore import decide_path, path_log, plan_tree_row
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

    def plan_tree(self, round: RoundBatch, policy: CheckpointPolicy) -> None:
        """A tree round's forward (its `round.tree` made): each row's snapshot slots under `policy`
        (`round.plans`, `round.snap_slot`; None without recurrent state, `tree_restore` has the
        rule) and the input log where some input has none and the policy logs; hidden states a
        drafter reads stay pending until the round lays out the accepted path's
        (`HiddenStates.follow_path`)."""
        if self.has_state and self.cache.ring_slots < 2:
            raise ConfigError(f"tree drafts need at least 2 ring slots in the target's cache, it has "
                              f"{self.cache.ring_slots}; no state was changed")
        round.snap_slot, round.plans, round.input_log = None, [None] * len(round.seq_ids), None
        if not self.has_state:
            return
        T, plan = round.num_inputs, round.tree.plan
        round.plans = [plan_tree_row(self.cache.states.ring_slots(seq), head, plan.depths[b], plan.spine(b), policy, T)
                       for b, (seq, head) in enumerate(zip(round.seq_ids, round.start_heads))]
        round.snap_slot = [list(p.snap_slot) for p in round.plans]
        if policy.log_inputs and any(len(p.survivors) < len(inputs) for p, inputs in zip(round.plans,
                                                                                           round.verify_inputs)):
            round.input_log = {}

    def commit_tree(self, round: RoundBatch) -> None:
        """Each live row at its boundary: the accepted inputs' K/V onto positions start ..
        start + n, and its state after the accepted input restored along the accepted path
        (`round.decisions`, in path coordinates: a head move, a log or a token replay)."""
        round.decisions = [None] * len(round.seq_ids)
        for b in round.live:
            seq, start, path = round.seq_ids[b], round.start_lens[b], round.paths[b]
            if self.cache.kv is not None:
                moved = [k for k, t in enumerate(path) if t != k]
                self.cache.kv.move_positions(seq, [start + path[k] for k in moved], [start + k for k in moved])
            if self.has_state:
                spare = next(s for s in self.cache.states.ring_slots(seq) if s != round.start_heads[b])
                round.decisions[b] = decide_path(round.plans[b], path, round.input_log is not None, spare)
        if self.has_state:
            self._replay_paths(round)
        for b in round.live:
            head = round.decisions[b].dst_slot if round.decisions[b] is not None else -1
            self.cache.commit(round.seq_ids[b], round.boundary(b), head)

    def _replay_paths(self, round: RoundBatch) -> None:
        """The log and token replays of `round.decisions` (path coordinates) along each row's path."""
        replays = [d is not None and d.path != "hit" for d in round.decisions]
        if not any(replays):
            return
        if round.input_log is not None:
            paths = [path if replay else None for path, replay in zip(round.paths, replays)]
            log = path_log(round.input_log, paths, round.num_inputs, self.model.device)
            log_replay(self.model, self.cache, round.decisions, log)
        path_tokens = [[inputs[t] for t in path] for inputs, path in zip(round.verify_inputs, round.paths)]
        token_replay(self.model, self.cache, round.seq_ids, round.decisions, path_tokens, round.start_lens)

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
        """Checkpoint bytes the round held: surviving snapshots, the input log and any input
        states a tree forward kept beside the ring."""
        slot_bytes = self.cache.states.bytes_per_slot if self.has_state else 0
        held = sum(len(p.survivors) * slot_bytes for p in round.plans if p is not None)
        if round.tree is not None:
            held += round.tree.nbytes()
        return held + sum(log.nbytes() for log in (round.input_log or {}).values())
