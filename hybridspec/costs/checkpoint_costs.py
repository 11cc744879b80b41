"""What a checkpoint policy costs on one model: the bytes a round holds
(`CheckpointFootprint`) and the seconds of snapshot writes, input logging and
replays (`CheckpointCosts`, measured by `hybridspec.checkpoints.measure`). The
`auto` policy (`checkpoints/auto.py`) chooses k and logging from these."""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import torch

from hybridspec.errors import ConfigError
from hybridspec.costs.checkpoint_terms import snapshot_writes_per_round
from hybridspec.costs.round_time import StepCosts
from hybridspec.cache.state_specs import bytes_per_slot, log_bytes_per_input

COST_FIELDS = ("snapshot_write_s", "log_write_s", "log_replay_fixed_s", "restore_s", "log_replay_step_s",
               "token_replay_fixed_s", "token_replay_step_s")
WHOLE_BATCH_FIELDS = ("snapshot_write_s", "log_write_s")


@dataclass(frozen=True)
class CheckpointFootprint:
    """Bytes one sequence keeps per snapshot slot and per logged verify input."""

    bytes_per_slot: int
    log_bytes_per_input: int

    @classmethod
    def of(cls, config, dtype: torch.dtype, state_dtype: torch.dtype) -> "CheckpointFootprint":
        """From a `HybridConfig`, the model dtype and the state dtype."""
        specs = config.recurrent_state_specs()
        return cls(bytes_per_slot(specs, state_dtype.itemsize),
                   log_bytes_per_input(specs, dtype.itemsize, state_dtype.itemsize))

    def checkpoint_bytes(self, batch: int, gamma: int, snapshot_every: int, log_inputs: bool) -> int:
        """bytes(k, log, B) of the module docstring."""
        writes = snapshot_writes_per_round(gamma, snapshot_every)
        return batch * (writes * self.bytes_per_slot + int(log_inputs) * (gamma + 1) * self.log_bytes_per_input)


def interpolate(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), extended linearly past
    the ends and clamped at 0; one point is a constant."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(ys[i] + slope * (x - xs[i]), 0.0)


@dataclass(frozen=True)
class CheckpointCosts:
    """Measured seconds of what a checkpoint policy changes, at the batch sizes
    `batches` (ascending), one value per batch in each field:

    snapshot_write_s: one more snapshot of every sequence in a verify forward;
    log_write_s: the input log of one verify input of every sequence;
    log_replay_fixed_s: a log-replay call, the part paid whatever rows replay;
    restore_s: each sequence that log-replays one step, on top of it;
    log_replay_step_s: each further log-replayed step of one sequence;
    token_replay_fixed_s: a token-replay forward, the part paid once;
    token_replay_step_s: each token-replayed token of one sequence.
    Between and beyond the measured batches they are interpolated linearly;
    from one measured batch, the two whole-batch fields scale with the batch.
    """

    batches: tuple[int, ...]
    snapshot_write_s: tuple[float, ...]
    log_write_s: tuple[float, ...]
    log_replay_fixed_s: tuple[float, ...]
    restore_s: tuple[float, ...]
    log_replay_step_s: tuple[float, ...]
    token_replay_fixed_s: tuple[float, ...]
    token_replay_step_s: tuple[float, ...]

    def __post_init__(self):
        batches = tuple(self.batches)
        if not batches or any(not isinstance(b, int) or b < 1 for b in batches) or list(batches) != sorted(set(batches)):
            raise ConfigError(f"CheckpointCosts.batches={self.batches!r} must be distinct ascending integers >= 1")
        for name in COST_FIELDS:
            values = tuple(float(v) for v in getattr(self, name))
            if len(values) != len(batches) or any(not math.isfinite(v) or v < 0 for v in values):
                raise ConfigError(f"CheckpointCosts.{name}={getattr(self, name)!r} must hold one finite number "
                                  f">= 0 (seconds) per batch in {batches}")
            object.__setattr__(self, name, values)
        object.__setattr__(self, "batches", batches)

    def at(self, name: str, batch: int) -> float:
        """Field `name` at `batch`, linear between the two nearest measured batches."""
        xs, ys = self.batches, getattr(self, name)
        if len(xs) == 1 and name in WHOLE_BATCH_FIELDS:
            return ys[0] * batch / xs[0]
        return interpolate(xs, ys, batch)

    def step_costs(self, batch: int) -> StepCosts:
        """`hs.sim.StepCosts` at `batch`; the draft, plain and verify steps every
        policy shares are 0."""
        at = {name: self.at(name, batch) for name in COST_FIELDS if name != "log_replay_fixed_s"}
        return StepCosts(batch=batch, plain_step_s=0.0, draft_step_s=0.0, verify_s=0.0, **at)
