"""Tree rounds under a checkpoint policy: which verify inputs of a tree get a
ring snapshot, and how the commit rebuilds the accepted input's state from
the nearest snapshotted ancestor (or the round-start head).

Where a row's ring holds one slot per input beside the pinned head and the
policy snapshots every input (k = 1), every input gets a slot and the commit
is a head move: the fast path. Otherwise the policy's depths are snapshotted
(`CheckpointPolicy.snapshot_inputs` over the tree's depths: 0, k, 2k, … and
the deepest for k > 1, the deepest only for k = 0), the spine's inputs (the
drafter's own chain, the likeliest path) before the other inputs, as many as
the ring holds; the forward logs every input's mixer inputs when the policy
logs. At the commit the accepted path is a chain: its inputs in path order
are restored as a chain's boundary is (`restore`), in path coordinates — a
hit where the accepted input has a snapshot, else a log replay of only the
path's inputs after the nearest snapshotted ancestor (its logged rows picked
out in path order, `LayerInputLog.along`) or, without a log, a token replay
of the path's tokens.

Exactness. A log replay runs the chain replay's per-step rule over the same
logged inputs the tree form stepped from the same ancestor state, so the
state is the forward's for that input, bit for bit (the torch forms against
the torch replay, the C tree forms against the native replay), where the
snapshot holds the ancestor's state unrounded: the state dtype is the forms'
accumulation dtype (float32 and float64 models with their default state
dtype; from the head always). Not bits: on CUDA the tree forms are torch's and
the replay is the Triton kernel (float32 rounding apart, as two kernels are);
a state dtype narrower than the accumulation's rounds a snapshotted ancestor,
as a chain's sparse snapshots do. A token replay runs the path's tokens as a
chain forward, whose attention is the chain's kernel, not the tree's masked
form: its state is the chain forward's, which the tree forward's agrees with
to rounding (about 1e-15 in float64 and 1e-7 in float32, as a plain decode).
"""
from __future__ import annotations

import torch

from hybridspec.checkpoints.input_log import InputLog
from hybridspec.checkpoints.restore import RestoreDecision
from hybridspec.checkpoints.ring import SnapshotPlan, plan_snapshots


def tree_snapshot_inputs(depths: list[int], spine: list[int], policy_inputs: list[int], free: int) -> list[int]:
    """The inputs of one row's tree that get a snapshot (ascending), at most `free`: those whose
    depth is among `policy_inputs` (the policy's snapshot indices over a chain as deep as the
    tree), the spine's first, then the others in input order."""
    wanted = set(policy_inputs)
    on_spine = set(spine)
    ranked = [t for t in spine if depths[t] in wanted]
    ranked += [t for t, d in enumerate(depths) if d in wanted and t not in on_spine]
    return sorted(ranked[:free])


def plan_tree_row(ring: list[int], head: int, depths: list[int], spine: list[int], policy, T: int) -> SnapshotPlan:
    """Where one row's tree forward writes its snapshots (`tree_snapshot_inputs`; never the head,
    no slot twice, so every planned snapshot survives the forward)."""
    chosen = tree_snapshot_inputs(depths, spine, policy.snapshot_inputs(max(depths) + 1), len(ring) - 1)
    return plan_snapshots(ring, head, chosen, T)


def decide_path(plan: SnapshotPlan, path: list[int], log_available: bool, spare: int) -> RestoreDecision:
    """How to reach the state after the last input of `path` (root first), in path
    coordinates (`src_input` and `boundary_input` index `path`): a hit, or a replay from the
    nearest snapshotted input of the path (-1: the head) into that snapshot's slot, or into
    `spare` (a ring slot other than the head) when it starts from the head."""
    n = len(path) - 1
    j = max((k for k, t in enumerate(path) if t in plan.survivors), default=-1)
    if j == n:
        slot = plan.survivors[path[n]]
        return RestoreDecision("hit", n, slot, slot, n)
    src = plan.survivors[path[j]] if j >= 0 else plan.head
    return RestoreDecision("log" if log_available else "token", j, src, src if j >= 0 else spare, n)


def path_log(input_log: InputLog, paths: list[list[int] | None], T: int, device) -> InputLog:
    """Each layer's log with row b's inputs along paths[b] in path order (padded with its last;
    None: a row that replays nothing)."""
    rows = [(p + [p[-1]] * (T - len(p))) if p else [0] * T for p in paths]
    inputs = torch.tensor(rows, dtype=torch.long, device=device).view(len(paths), T)  # [batch, T]
    return {layer: log.along(inputs) for layer, log in input_log.items()}
