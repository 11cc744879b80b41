"""Log replay through the forward's own C loops (`cpu.mamba2` / `cpu.mamba1`
and `cpu.conv`) over the replayed rows, with a plan that writes only each
row's last replayed input, into its destination slot: the state is the one
the forward would have snapshotted there, bit for bit, since it is the same
code over the same inputs (Mamba-1's torch reference differs from its C loop
in the last bits: another exp). The references run each input as a few
whole-state operations over every row."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.kernels.cpu import conv as cpu_conv


@dataclass(frozen=True)
class ReplayPlan:
    """What the C state loops read of a forward's `SlotPlan`, for a log replay:
    each replayed row starts from slot src[b] and writes the state after its
    last replayed input only (live_snap[b, t] = -1 elsewhere). Inputs past a
    row's last run too, writing nothing; their outputs are dropped."""
    src: torch.Tensor  # [rows] int64
    live_snap: torch.Tensor  # [rows, T] int64
    all_live: bool = True  # no output is kept, so none needs zeroing

    @property
    def batch(self) -> int:
        return self.src.shape[0]

    @staticmethod
    def of(src: list[int], dst: list[int], steps: list[int]) -> "ReplayPlan":
        length = max(steps)
        snap = [[d if t == n - 1 else -1 for t in range(length)] for d, n in zip(dst, steps)]
        return ReplayPlan(torch.tensor(src, dtype=torch.long), torch.tensor(snap, dtype=torch.long))


def replay_native(steps_fn, applies_fn, ssm, conv, src_slot, dst_slot, first, num_steps, log, A, D, conv_weight,
                  conv_bias) -> bool:
    """A log replay through the forward's C loops, over the rows that replay;
    False, with nothing written, where those loops do not take the shapes."""
    T = log.x.shape[1]
    src, dst, starts = src_slot.tolist(), dst_slot.tolist(), first.tolist()
    steps = [max(0, min(n, T)) for n in num_steps.tolist()]
    rows = [b for b in range(len(dst)) if dst[b] >= 0 and steps[b] > 0]
    copies = [b for b in range(len(dst)) if dst[b] >= 0 and steps[b] == 0 and dst[b] != src[b]]
    if rows:
        plan = ReplayPlan.of([src[b] for b in rows], [dst[b] for b in rows], [steps[b] for b in rows])
        length = plan.live_snap.shape[1]
        start = starts[rows[0]]
        if any(starts[b] != start for b in rows) or start + length > T:  # each row's own start (and
            log, start = log.shifted(first), 0  # the last input repeated past the log's end, as the references)
        index = None if rows == list(range(len(dst))) else torch.tensor(rows, dtype=torch.long)
        x, dt, B, C, xs = ((t if index is None else t.index_select(0, index))[:, start:start + length]
                           for t in (log.x, log.dt, log.B, log.C, log.xs))
        weight = conv_weight  # [conv_dim, d_conv]
        if not (applies_fn(ssm, x, plan)
                and cpu_conv.applies(conv, xs, weight, conv_bias, "silu", plan)):
            return False
    for b in copies:  # no inputs: the source state as it is
        ssm[dst[b]] = ssm[src[b]]
        conv[dst[b]] = conv[src[b]]
    if rows:
        steps_fn(ssm, plan, x, dt, A, B, C, D)  # its outputs dropped
        cpu_conv.conv_window_steps(conv, plan, xs, weight, conv_bias, "silu")
    return True