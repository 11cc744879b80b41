"""Monte Carlo of the acceptance process, to confirm the closed forms.

Each round draws γ independent uniforms; draft i is accepted when its uniform
is below α and every earlier draft was accepted. Rounds are simulated in
vectorised chunks, so 10^6 rounds take a few tens of milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from hybridspec.costs.checkpoint_terms import snapshot_positions
from hybridspec.costs.validation import check_alpha, check_gamma, check_int, check_snapshot_every

_CHUNK_ROUNDS = 1 << 17


@dataclass(frozen=True)
class SimResult:
    """Sample mean of a per-round quantity and its standard error."""

    mean: float
    stderr: float
    rounds: int


def _accepted_chunks(alpha: float, gamma: int, rounds: int, seed: int) -> Iterator[np.ndarray]:
    """Yield accepted-draft counts n (0..γ) for `rounds` rounds, chunk by chunk."""
    rng = np.random.default_rng(seed)
    remaining = rounds
    while remaining > 0:
        size = min(remaining, _CHUNK_ROUNDS)
        is_accepted = rng.random((size, gamma)) < alpha  # [size, gamma]
        # a draft counts only if every earlier draft was accepted too
        accepted = np.logical_and.accumulate(is_accepted, axis=1).sum(axis=1)  # [size]
        yield accepted
        remaining -= size


def _mean_and_stderr(chunks: Iterator[np.ndarray], rounds: int) -> SimResult:
    total, total_sq = 0.0, 0.0
    for values in chunks:
        values = values.astype(np.float64)
        total += float(values.sum())
        total_sq += float(np.square(values).sum())
    mean = total / rounds
    if rounds < 2:
        return SimResult(mean=mean, stderr=math.nan, rounds=rounds)
    variance = max(total_sq - rounds * mean * mean, 0.0) / (rounds - 1)
    return SimResult(mean=mean, stderr=math.sqrt(variance / rounds), rounds=rounds)


def _check_run(alpha: float, gamma: int, rounds: int, seed: int) -> tuple[float, int, int, int]:
    return (
        check_alpha(alpha),
        check_gamma(gamma),
        check_int(rounds, "rounds", minimum=1),
        check_int(seed, "seed", minimum=0),
    )


def simulate_with_stderr(alpha: float, gamma: int, rounds: int, seed: int = 0) -> SimResult:
    """Emitted tokens per round (n + 1) over `rounds` simulated rounds."""
    alpha, gamma, rounds, seed = _check_run(alpha, gamma, rounds, seed)
    emitted = (accepted + 1 for accepted in _accepted_chunks(alpha, gamma, rounds, seed))
    return _mean_and_stderr(emitted, rounds)


def simulate(alpha: float, gamma: int, rounds: int, seed: int = 0) -> float:
    """Mean emitted tokens per round of a Monte Carlo run; the simulated
    counterpart of `expected_tokens(alpha, gamma)`. `simulate_with_stderr`
    returns the standard error too."""
    return simulate_with_stderr(alpha, gamma, rounds, seed).mean


def simulate_replay_steps(
    alpha: float, gamma: int, snapshot_every: int, rounds: int, seed: int = 0
) -> SimResult:
    """Replayed steps per sequence per round, found by looking up, for each
    simulated boundary n, the latest state at or before it: a snapshot
    position from `snapshot_positions`, or the round-start state (position
    −1). The simulated counterpart of `expected_replay_steps`."""
    alpha, gamma, rounds, seed = _check_run(alpha, gamma, rounds, seed)
    k = check_snapshot_every(snapshot_every)
    kept_states = np.array((-1,) + snapshot_positions(gamma, k))  # [num_kept], ascending
    replayed = (
        accepted - kept_states[np.searchsorted(kept_states, accepted, side="right") - 1]
        for accepted in _accepted_chunks(alpha, gamma, rounds, seed)
    )
    return _mean_and_stderr(replayed, rounds)
