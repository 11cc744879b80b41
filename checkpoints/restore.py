"""`restore`: move every recurrent layer of each sequence to its accepted boundary.

Three paths, cheapest first:
- snapshot hit: a ring slot holds the state after input n; the head moves
  there (no copy);
- log replay: run only the SSM recurrence and the conv window from the
  nearest earlier snapshot over the logged inputs (each layer's own
  `replay` over its own log);
- token replay: without a log, run the model forward over the tokens since
  the nearest earlier snapshot (attention K/V are rewritten with the same
  values).
The round-start head is never written, so a failure before the final commit
can always return a sequence to where the round began.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hybridspec.checkpoints.input_log import InputLog
from hybridspec.checkpoints.ring import SnapshotPlan


@dataclass
class RestoreDecision:
    path: Literal["hit", "log", "token"]
    src_input: int  # verify-input index of the state replay starts from (-1: the round-start head)
    src_slot: int
    dst_slot: int  # the slot that becomes the head
    boundary_input: int  # n: the state after verify input n is wanted

    @property
    def num_steps(self) -> int:
        return self.boundary_input - self.src_input


def decide(plan: SnapshotPlan, n: int, log_available: bool) -> RestoreDecision:
    """The cheapest path to the state after verify input `n`."""
    if n in plan.survivors:
        slot = plan.survivors[n]
        return RestoreDecision("hit", n, slot, slot, n)
    j, src = plan.nearest_at_or_before(n)
    # replay writes in place over a snapshot slot, never over the pinned head
    dst = src if src != plan.head else next(s for s in plan.snap_slot if s >= 0)
    return RestoreDecision("log" if log_available else "token", j, src, dst, n)


def log_replay(model, cache, decisions: list[RestoreDecision | None], input_log: InputLog) -> None:
    """Run the logged recurrence of every recurrent layer of `model` for the
    rows whose decision is a log replay (others: dst = -1, untouched)."""
    rows = [d if d is not None and d.path == "log" else None for d in decisions]
    if not any(rows):
        return
    device = model.device

    def column(get, default):
        return torch.tensor([get(d) if d is not None else default for d in rows], dtype=torch.long, device=device)

    src = column(lambda d: d.src_slot, 0)
    dst = column(lambda d: d.dst_slot, -1)
    first = column(lambda d: d.src_input + 1, 0)
    steps = column(lambda d: d.num_steps, 0)
    for layer in model.recurrent_layers:
        layer.replay(cache.states, src, dst, first, steps, input_log[layer.state_layer])


def token_replay(model, cache, seq_ids: list[int], decisions: list[RestoreDecision | None],
                 verify_inputs: list[list[int]], start_lens: list[int]) -> None:
    """Re-run the model over the inputs after each row's nearest snapshot,
    starting from that snapshot; the state at the boundary lands in the row's
    `dst_slot` (the caller commits the boundary)."""
    rows = [i for i, d in enumerate(decisions) if d is not None and d.path == "token"]
    if not rows:
        return
    for i in rows:  # verify inputs 0..src are accepted (src <= n): commit them, the snapshot holds their state
        d = decisions[i]
        cache.commit(seq_ids[i], start_lens[i] + d.src_input + 1, d.src_slot)
    tokens = [verify_inputs[i][decisions[i].src_input + 1: decisions[i].boundary_input + 1] for i in rows]
    T = max(map(len, tokens))
    snap = torch.full((len(rows), T), -1, dtype=torch.long, device=model.device)
    for r, i in enumerate(rows):
        snap[r, len(tokens[r]) - 1] = decisions[i].dst_slot
    model.extend(cache, [seq_ids[i] for i in rows], tokens, last_only=True, snap_slot=snap)
