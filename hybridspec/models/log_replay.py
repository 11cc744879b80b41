"""Log replay shared by the Mamba mixers (their `RecurrentLayer.replay`):
rebuild a state from a snapshot by running only the recurrence and the conv
window over logged inputs.

On CPU in float32 (the native kernels on) the replay runs the forward's own C
loops (`cpu_mamba2` / `cpu_mamba1` and `cpu_conv`) over the replayed rows,
with a plan that writes only each row's last replayed input, into its
destination slot: the state is the one the forward would have snapshotted
there, bit for bit, since it is the same code over the same inputs (Mamba-1's
torch reference differs from its C loop in the last bits: another exp). The
references run each input as a few whole-state operations over every row:
one row's replay of 3 inputs in the 7 Mamba layers of
`benches/memory_vs_replay.py`'s model took 4.5 ms there, 0.5 ms here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.checkpoints.input_log import MambaInputLog
from hybridspec.checkpoints.state_pool import StatePool
from hybridspec.kernels import cpu_conv, cpu_native
from hybridspec.kernels.conv_window import conv_window_rebuild, conv_window_rebuild_ref
from hybridspec.kernels.dispatch import pick


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


class LogReplay:
    """Mixin for a mixer with `state_layer`, `A_log`, `D`, `conv_weight`,
    `conv_bias`, `replay_kernels` = (Triton launcher, torch reference) of its
    SSM replay, and `native_steps` / `native_applies`: its forward's C
    recurrence (`cpu_mamba2` or `cpu_mamba1`) and the shapes it takes."""

    replay_kernels: tuple
    native_steps: staticmethod
    native_applies: staticmethod

    def replay(self, states: StatePool, src_slot: torch.Tensor, dst_slot: torch.Tensor, first: torch.Tensor,
               num_steps: torch.Tensor, log: MambaInputLog) -> None:
        """Advance the state (SSM and conv window) in src_slot over logged
        inputs first..first+num_steps-1 and write it to dst_slot (rows with
        dst_slot = -1 untouched). All index tensors are [batch]."""
        A = -torch.exp(self.A_log.to(log.dt.dtype))
        ssm, conv = states.ssm_states[self.state_layer], states.conv_states[self.state_layer]
        if cpu_native.takes(ssm, conv, log.x) and self._replay_native(ssm, conv, src_slot, dst_slot, first,
                                                                      num_steps, log, A):
            return
        log = log.shifted(first)
        replay = pick(*self.replay_kernels, log.x)
        replay(ssm, src_slot, dst_slot, num_steps, log.x, log.dt, A, log.B, log.C)
        pick(conv_window_rebuild, conv_window_rebuild_ref, log.x)(conv, src_slot, dst_slot, num_steps, log.xs)

    def _replay_native(self, ssm, conv, src_slot, dst_slot, first, num_steps, log: MambaInputLog, A) -> bool:
        """`replay` through the forward's C loops, over the rows that replay;
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
            weight = self.conv_weight[:, 0]  # [conv_dim, d_conv]
            if not (type(self).native_applies(ssm, x, plan)
                    and cpu_conv.applies(conv, xs, weight, self.conv_bias, "silu", plan)):
                return False
        for b in copies:  # no inputs: the source state as it is
            ssm[dst[b]] = ssm[src[b]]
            conv[dst[b]] = conv[src[b]]
        if rows:
            type(self).native_steps(ssm, plan, x, dt, A, B, C, self.D)  # its outputs dropped
            cpu_conv.conv_window_steps(conv, plan, xs, weight, self.conv_bias, "silu")
        return True
