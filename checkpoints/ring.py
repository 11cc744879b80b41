"""Snapshot placement in a sequence's ring for one verify forward.

The head slot (state at the round start, position m-1) is pinned: snapshot
writes go to the other slots in order, wrapping around so that, with too few
slots, a later snapshot overwrites the oldest one.

Ring halves: when the ring holds at least two slots per snapshot (2S for S
snapshots), the i-th snapshot goes to ring offset S + i if the head lies in
the first half (offsets < S), else to offset i. The head after a round is
always one of the round's snapshots (or a replay over one), so it lies in the
half just written, and every row that started in the same half writes the
same offsets every round: with the pool's offset-major layout, the rows'
step-t slots form one span and the torch recurrence computes into them in
place instead of copying each state after computing it. A row that joins
with its head in the other half is moved once (`HybridCache.align_heads`:
its head state copied into the majority's half).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridspec.cache.state_pool import head_half


@dataclass
class SnapshotPlan:
    """Where the snapshots of one sequence's verify forward go."""

    head: int  # pinned slot: the state before input 0
    snap_slot: list[int]  # [num_inputs] slot written after input t, -1 for none
    survivors: dict[int, int]  # input index -> slot still holding the state after it

    def nearest_at_or_before(self, n: int) -> tuple[int, int]:
        """(input index j ≤ n, slot) of the closest surviving snapshot; j = -1 is the head."""
        earlier = [j for j in self.survivors if j <= n]
        if not earlier:
            return -1, self.head
        j = max(earlier)
        return j, self.survivors[j]


def plan_snapshots(ring: list[int], head: int, snapshot_inputs: list[int], num_inputs: int) -> SnapshotPlan:
    """Assign `snapshot_inputs` (ascending verify-input indices) to the ring
    slots other than `head`, oldest overwritten first."""
    snap_slot = [-1] * num_inputs
    holder: dict[int, int] = {}  # slot -> input index it holds
    at, count = ring.index(head), len(snapshot_inputs)
    half = head_half(ring, head, count)
    if half is not None:  # ring halves (module docstring)
        ordered = ring[count:2 * count] if half == "low" else ring[:count]
    else:
        free = [s for s in ring if s != head]
        ordered = free[at:] + free[:at]  # walk the ring from just after the head
    for i, t in enumerate(snapshot_inputs):
        slot = ordered[i % len(ordered)]
        snap_slot[t] = slot
        holder[slot] = t
    return SnapshotPlan(head, snap_slot, {t: s for s, t in holder.items()})
