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


def simulate_tree(alpha: float, widths: tuple[int, ...], rescue: float, rounds: int,
                  seed: int = 0) -> SimResult:
    """Emitted tokens per round of a spine with leaf alternatives, draw by draw:
    at each depth the spine's token is accepted with α; when not, the target's
    token's rank past the first is geometric (each next ranked token is it with
    probability `rescue`), and an alternative catches it when that rank is
    within the depth's width (the round then ends). The simulated counterpart
    of `costs.tree_form.tree_expected_tokens`."""
    alpha, rounds, seed = check_alpha(alpha), check_int(rounds, "rounds", minimum=1), check_int(seed, "seed", minimum=0)
    rescue = check_alpha(rescue, name="rescue")
    widths = np.array([check_int(w, "width", minimum=1) for w in widths])  # [depths]
    rng = np.random.default_rng(seed)

    def chunks() -> Iterator[np.ndarray]:
        remaining = rounds
        while remaining > 0:
            size = min(remaining, _CHUNK_ROUNDS)
            on_spine = rng.random((size, len(widths))) < alpha  # [size, depths]
            rank = rng.geometric(rescue, (size, len(widths))) if rescue > 0 else \
                np.full((size, len(widths)), np.iinfo(np.int64).max)  # [size, depths] alternatives tried until the target's
            caught = ~on_spine & (rank <= widths - 1)  # [size, depths] an alternative holds the target's token
            reached = np.logical_and.accumulate(np.concatenate(
                [np.ones((size, 1), bool), on_spine[:, :-1]], axis=1), axis=1)  # [size, depths] the spine got here
            accepted = (reached & (on_spine | caught)).sum(axis=1)  # [size]
            yield accepted + 1
            remaining -= size

    return _mean_and_stderr(chunks(), rounds)
