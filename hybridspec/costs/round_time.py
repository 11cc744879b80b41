"""The expected seconds of one round under a checkpoint policy (`round_time`),
from the seconds of its steps (`StepCosts`): measured by the engine (`auto`)
or from the roofline (`hybridspec.sim.CostModel`). docs/simulator.md derives
every term."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from hybridspec.costs.checkpoint_terms import (
    expected_replay_steps,
    replay_probability,
    snapshot_writes_per_round,
)
from hybridspec.costs.validation import check_gamma, check_int
from hybridspec.errors import ConfigError

# a batch size >= 1, or an integer array of them  # [num_batches]
Batch = Union[int, np.ndarray]


@dataclass(frozen=True)
class StepCosts:
    """Seconds at one batch size and γ: the inputs of `round_time`, from the
    roofline (`CostModel.step_costs`) or measured by the engine. Fields may be
    arrays (one entry per batch size) when `batch` is.

    plain_step_s: one plain target decode step (1 token per sequence).
    draft_step_s: one drafter forward (1 token per sequence); 0 for an n-gram drafter.
    verify_s: the target forward over γ+1 tokens per sequence, reading the
        state once and writing only the final state.
    snapshot_write_s: one more snapshot of every Mamba layer, whole batch.
    log_write_s: the input log of one verify input, whole batch.
    restore_s: per replaying sequence: read a snapshot, write the rebuilt state.
    log_replay_step_s: per sequence per log-replayed step.
    token_replay_fixed_s: the weight read of a token-replay forward, paid
        once per round when any sequence token-replays.
    token_replay_step_s: per sequence per token-replayed token.
    """

    batch: Batch
    plain_step_s: Union[float, np.ndarray]
    draft_step_s: Union[float, np.ndarray]
    verify_s: Union[float, np.ndarray]
    snapshot_write_s: Union[float, np.ndarray]
    log_write_s: Union[float, np.ndarray]
    restore_s: float
    log_replay_step_s: float
    token_replay_fixed_s: float
    token_replay_step_s: float


@dataclass(frozen=True)
class RoundTime:
    """Expected seconds of one round for the whole batch, by phase."""

    draft_s: Union[float, np.ndarray]
    verify_s: Union[float, np.ndarray]
    checkpoint_s: Union[float, np.ndarray]  # extra snapshot writes + input log writes
    replay_s: Union[float, np.ndarray]

    @property
    def total_s(self) -> Union[float, np.ndarray]:
        return self.draft_s + self.verify_s + self.checkpoint_s + self.replay_s


def check_batch(batch: Batch) -> Batch:
    if isinstance(batch, np.ndarray):
        if batch.size == 0 or not np.issubdtype(batch.dtype, np.integer) or batch.min() < 1:
            raise ConfigError(f"batch={batch!r} is invalid: pass integers >= 1")
        return batch
    return check_int(batch, "batch", minimum=1)


def round_time(
    costs: StepCosts, gamma: int, alpha: float, snapshot_every: int = 1, log_inputs: bool = True
) -> RoundTime:
    """Expected time of one round (draft → verify → commit) for policy
    `CheckpointPolicy(snapshot_every, log_inputs=log_inputs)`:

        draft      = γ · draft_step
        verify     = verify_s
        checkpoint = (writes_k − 1) · snapshot_write + [log] (γ+1) · log_write
        replay     = B·p_k·restore + [log]   B·E_k·log_replay_step
                                   + [¬log] (1 − (1 − p_k)^B)·token_replay_fixed
                                            + B·E_k·token_replay_step
    with writes_k = `snapshot_writes_per_round`, p_k = `replay_probability`
    and E_k = `expected_replay_steps`. The drafter's own rollback is free (it
    keeps each draft step's state in its own slot).
    """
    gamma = check_gamma(gamma)
    batch = check_batch(costs.batch)
    extra_snapshots = snapshot_writes_per_round(gamma, snapshot_every) - 1
    replay_p = replay_probability(alpha, gamma, snapshot_every)
    replay_steps = expected_replay_steps(alpha, gamma, snapshot_every)
    checkpoint_s = extra_snapshots * costs.snapshot_write_s
    replay_s = batch * replay_p * costs.restore_s
    if log_inputs:
        checkpoint_s = checkpoint_s + (gamma + 1) * costs.log_write_s
        replay_s = replay_s + batch * replay_steps * costs.log_replay_step_s
    else:
        any_replays = 1.0 - (1.0 - replay_p) ** batch
        replay_s = replay_s + any_replays * costs.token_replay_fixed_s
        replay_s = replay_s + batch * replay_steps * costs.token_replay_step_s
    return RoundTime(
        draft_s=gamma * costs.draft_step_s,
        verify_s=costs.verify_s,
        checkpoint_s=checkpoint_s,
        replay_s=replay_s,
    )
