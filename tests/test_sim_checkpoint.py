"""Checkpoint-policy terms: snapshot positions and writes, replay steps per
boundary, and the expected replay closed form against a direct sum and a
Monte Carlo that looks up kept states independently of the formula."""
import pytest

from hybridspec.errors import ConfigError
from hybridspec.sim import (
    accepted_distribution,
    expected_replay_steps,
    expected_tokens,
    replay_probability,
    replay_steps,
    simulate_replay_steps,
    snapshot_positions,
    snapshot_writes_per_round,
)


@pytest.mark.parametrize(
    "gamma, k, positions",
    [
        (6, 1, (0, 1, 2, 3, 4, 5, 6)),
        (6, 2, (0, 2, 4, 6)),
        (6, 4, (0, 4, 6)),
        (6, 0, (6,)),
        (6, 10, (0, 6)),
        (1, 2, (0, 1)),
        (4, 0, (4,)),
    ],
)
def test_snapshot_positions_follow_the_policy(gamma, k, positions):
    assert snapshot_positions(gamma, k) == positions
    assert snapshot_writes_per_round(gamma, k) == len(positions)


def test_replay_steps_per_boundary():
    # k = 3, γ = 7: snapshots after inputs 0, 3, 6, 7
    assert [replay_steps(n, 7, 3) for n in range(8)] == [0, 1, 2, 0, 1, 2, 0, 0]
    # k = 0, γ = 4: only the round-start state and the final state are kept
    assert [replay_steps(n, 4, 0) for n in range(5)] == [1, 2, 3, 4, 0]
    assert [replay_steps(n, 4, 1) for n in range(5)] == [0] * 5
    with pytest.raises(ConfigError, match="accepted=5"):
        replay_steps(5, 4, 1)


@pytest.mark.parametrize("alpha", (0.0, 0.3, 0.7, 0.95, 1.0))
def test_expected_replay_is_zero_when_every_input_is_snapshotted(alpha):
    for gamma in range(1, 9):
        assert expected_replay_steps(alpha, gamma, 1) == 0.0
        assert replay_probability(alpha, gamma, 1) == 0.0


@pytest.mark.parametrize("alpha", (0.0, 0.25, 0.6, 0.8, 0.95, 1.0))
@pytest.mark.parametrize("k", (0, 1, 2, 3, 4, 5, 9))
def test_expected_replay_closed_form_equals_direct_sum(alpha, k):
    for gamma in range(1, 10):
        probs = accepted_distribution(alpha, gamma)  # [gamma + 1]
        steps = [replay_steps(n, gamma, k) for n in range(gamma + 1)]
        assert expected_replay_steps(alpha, gamma, k) == pytest.approx(
            sum(p * s for p, s in zip(probs, steps)), abs=1e-12
        )
        assert replay_probability(alpha, gamma, k) == pytest.approx(
            sum(p for p, s in zip(probs, steps) if s > 0), abs=1e-12
        )


def test_k0_replay_is_tokens_minus_full_acceptance():
    for alpha in (0.5, 0.8):
        for gamma in (1, 4, 8):
            expected = expected_tokens(alpha, gamma) - (gamma + 1) * alpha**gamma
            assert expected_replay_steps(alpha, gamma, 0) == pytest.approx(expected, rel=1e-12)


def test_expected_replay_matches_simulation():
    # 3 α × 5 γ × 5 k = 75 cells; 4 standard errors keeps the chance of a
    # false alarm over all cells below 1% (Bonferroni) for a correct formula.
    cells = [(a, g, k) for a in (0.6, 0.8, 0.95) for g in (1, 2, 4, 5, 8) for k in (0, 1, 2, 3, 5)]
    for index, (alpha, gamma, k) in enumerate(cells):
        result = simulate_replay_steps(alpha, gamma, k, rounds=100_000, seed=500 + index)
        closed = expected_replay_steps(alpha, gamma, k)
        assert abs(result.mean - closed) <= 4 * result.stderr + 1e-12, (alpha, gamma, k, result, closed)


def test_replay_simulation_tells_policies_apart():
    k2 = simulate_replay_steps(0.8, 8, 2, rounds=100_000, seed=1)
    assert abs(k2.mean - expected_replay_steps(0.8, 8, 3)) > 10 * k2.stderr
    assert simulate_replay_steps(0.8, 8, 1, rounds=10_000, seed=1).mean == 0.0


def test_more_snapshots_mean_less_replay():
    for alpha in (0.6, 0.9):
        by_k = [expected_replay_steps(alpha, 8, k) for k in (1, 2, 4, 8, 0)]
        assert by_k == sorted(by_k) and by_k[0] == 0.0 and by_k[-1] > by_k[-2]
