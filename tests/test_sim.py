"""hs.sim closed forms and Monte Carlo: expected tokens, speedup, optimal γ, validation."""
import math
import time

import numpy as np
import pytest

from hybridspec.errors import ConfigError
from hybridspec.sim import (
    accepted_distribution,
    alpha_from_acceptance_rate,
    expected_accepted,
    expected_replay_steps,
    expected_tokens,
    optimal_gamma,
    simulate,
    simulate_with_stderr,
    speedup,
)

ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
GAMMAS = tuple(range(1, 9))


def test_expected_tokens_known_values():
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616, abs=1e-12)
    assert round(expected_tokens(0.7, 5), 4) == 2.9412


@pytest.mark.parametrize("gamma", GAMMAS)
def test_alpha_one_gives_gamma_plus_one_and_alpha_zero_gives_one(gamma):
    assert expected_tokens(1.0, gamma) == gamma + 1
    assert expected_tokens(0.0, gamma) == 1.0
    assert simulate(1.0, gamma, rounds=1000, seed=1) == gamma + 1
    assert simulate(0.0, gamma, rounds=1000, seed=1) == 1.0


@pytest.mark.parametrize("alpha", ALPHAS)
def test_expected_tokens_equals_quotient_and_distribution_mean(alpha):
    for gamma in GAMMAS:
        quotient = (1 - alpha ** (gamma + 1)) / (1 - alpha)
        probs = accepted_distribution(alpha, gamma)  # [gamma + 1]
        assert probs.sum() == pytest.approx(1.0, abs=1e-12)
        assert expected_tokens(alpha, gamma) == pytest.approx(quotient, rel=1e-12)
        assert float(probs @ (np.arange(gamma + 1) + 1)) == pytest.approx(quotient, rel=1e-12)


def test_simulation_matches_closed_form_within_three_standard_errors():
    for index, (alpha, gamma) in enumerate((a, g) for a in ALPHAS for g in GAMMAS):
        result = simulate_with_stderr(alpha, gamma, rounds=200_000, seed=100 + index)
        assert result.rounds == 200_000 and result.stderr > 0
        assert abs(result.mean - expected_tokens(alpha, gamma)) < 3 * result.stderr, (alpha, gamma, result)


def test_simulation_tells_nearby_alphas_apart():
    result = simulate_with_stderr(0.7, 5, rounds=200_000, seed=7)
    assert abs(result.mean - expected_tokens(0.72, 5)) > 5 * result.stderr


def test_simulate_is_reproducible_and_returns_the_mean():
    first = simulate_with_stderr(0.8, 4, rounds=50_000, seed=3)
    assert simulate(0.8, 4, rounds=50_000, seed=3) == first.mean
    assert simulate(0.8, 4, rounds=50_000, seed=4) != first.mean


def test_simulate_a_million_rounds_well_under_a_second():
    best = math.inf
    for _ in range(2):  # best of two, the machine is shared
        start = time.perf_counter()
        simulate(0.8, 8, rounds=1_000_000, seed=0)
        best = min(best, time.perf_counter() - start)
    assert best < 1.0


def test_speedup_known_values_and_regimes():
    assert speedup(0.7, 5, 0.05, verify_cost=1.0) == pytest.approx(2.35, abs=0.005)
    assert speedup(0.7, 5, 0.05, verify_cost=6.0) < 1.0
    for alpha in (0.5, 0.6, 0.7, 0.8, 0.9):
        for gamma in GAMMAS:
            assert speedup(alpha, gamma, 0.05, verify_cost=1.0) > 1.0  # memory-bound: a gain
            assert speedup(alpha, gamma, 0.05, verify_cost=gamma + 1.0) < 1.0  # compute-bound: a loss


def test_speedup_decreases_with_draft_and_verify_cost():
    costs = np.linspace(0.0, 2.0, 21)
    by_c = [speedup(0.8, 4, c, 1.0) for c in costs]
    by_verify = [speedup(0.8, 4, 0.05, 0.1 + v) for v in costs]
    assert all(a > b for a, b in zip(by_c, by_c[1:]))
    assert all(a > b for a, b in zip(by_verify, by_verify[1:]))


@pytest.mark.parametrize("alpha", (0.3, 0.5, 0.7, 0.8, 0.9, 0.97))
def test_optimal_gamma_is_the_argmax(alpha):
    for c in (0.0, 0.02, 0.1, 0.3):
        best = optimal_gamma(alpha, c, 1.0, max_gamma=20)
        values = [speedup(alpha, gamma, c, 1.0) for gamma in range(1, 21)]
        assert values[best - 1] == pytest.approx(max(values), rel=1e-9)
        compute_bound = optimal_gamma(alpha, c, lambda gamma: gamma + 1.0, max_gamma=20)
        values = [speedup(alpha, gamma, c, gamma + 1.0) for gamma in range(1, 21)]
        assert values[compute_bound - 1] == pytest.approx(max(values), rel=1e-9)


def test_optimal_gamma_grows_with_alpha():
    picks = [optimal_gamma(alpha, 0.05) for alpha in (0.5, 0.7, 0.8, 0.9)]
    assert picks == sorted(picks) and picks[0] < picks[-1]


@pytest.mark.parametrize("alpha", (0.0, 0.3, 0.78, 0.99, 1.0))
def test_acceptance_rate_inverts_to_alpha(alpha):
    rate = expected_accepted(alpha, 5) / 5
    assert alpha_from_acceptance_rate(rate, 5) == pytest.approx(alpha, abs=1e-9)


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda: expected_tokens(-0.1, 4), ("alpha=-0.1", "[0, 1]")),
        (lambda: expected_tokens(1.1, 4), ("alpha=1.1", "[0, 1]")),
        (lambda: expected_tokens(float("nan"), 4), ("alpha=nan", "finite")),
        (lambda: expected_tokens(float("inf"), 4), ("alpha=inf", "finite")),
        (lambda: expected_tokens(0.5, 0), ("gamma=0", ">= 1")),
        (lambda: expected_tokens(0.5, 2.5), ("gamma=2.5", "integer")),
        (lambda: expected_tokens(0.5, True), ("gamma=True", "integer")),
        (lambda: speedup(0.5, 4, -0.1), ("c=-0.1", ">= 0")),
        (lambda: speedup(0.5, 4, float("nan")), ("c=nan", "finite")),
        (lambda: speedup(0.5, 4, 0.05, verify_cost=0.0), ("verify_cost=0.0", "> 0")),
        (lambda: simulate(0.5, 4, rounds=0, seed=0), ("rounds=0", ">= 1")),
        (lambda: simulate(0.5, 4, rounds=10, seed=-1), ("seed=-1", ">= 0")),
        (lambda: simulate(2.0, 4, rounds=10, seed=0), ("alpha=2.0", "[0, 1]")),
        (lambda: optimal_gamma(0.5, 0.05, max_gamma=0), ("max_gamma=0", ">= 1")),
        (lambda: expected_replay_steps(0.5, 4, -1), ("snapshot_every=-1", ">= 0")),
        (lambda: alpha_from_acceptance_rate(1.5, 4), ("acceptance_rate=1.5", "[0, 1]")),
    ],
)
def test_invalid_inputs_raise_config_error_naming_value_and_range(call, names):
    with pytest.raises(ConfigError) as error:
        call()
    for name in names:
        assert name in str(error.value)
