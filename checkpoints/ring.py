"""Snapshot placement in a sequence's ring for one verify forward.

The head slot (state at the round start, position m-1) is pinned: snapshot
writes go to the other slots in order, wrapping around so that, with too few
slots, a later snapshot overwrites the oldest one.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    free = [s for s in ring if s != head]
    snap_slot = [-1] * num_inputs
    holder: dict[int, int] = {}  # slot -> input index it holds
    start = ring.index(head) + 1
    ordered = free[start - 1:] + free[:start - 1]  # walk the ring from just after the head
    for i, t in enumerate(snapshot_inputs):
        slot = ordered[i % len(ordered)]
        snap_slot[t] = slot
        holder[slot] = t
    return SnapshotPlan(head, snap_slot, {t: s for s, t in holder.items()})
