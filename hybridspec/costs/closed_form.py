"""Closed forms of speculative decoding under i.i.d. acceptance.

Symbols (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", §3):
    α            probability that one draft is accepted, independently per draft
    γ            drafts proposed per sequence per round
    n            accepted drafts in a round, 0..γ (capped geometric)
    c            cost of one draft step, in units of one plain target decode step
    verify_cost  cost of one verification forward over γ+1 tokens, same units

A round emits n + 1 tokens (the accepted drafts plus one recovered or bonus
token), with P(n) = α^n (1 − α) for n < γ and P(γ) = α^γ.
"""
from __future__ import annotations

import math
from typing import Callable, Union

import numpy as np

from hybridspec.costs.validation import check_alpha, check_cost, check_gamma, check_int

VerifyCost = Union[float, Callable[[int], float]]


def accepted_distribution(alpha: float, gamma: int) -> np.ndarray:
    """P(n accepted) for n = 0..γ.  # [gamma + 1]"""
    alpha, gamma = check_alpha(alpha), check_gamma(gamma)
    n = np.arange(gamma + 1)
    probs = alpha**n * (1.0 - alpha)  # [gamma + 1]
    probs[gamma] = alpha**gamma
    return probs


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected emitted tokens per round, Leviathan et al. eq. (1):
    E[n + 1] = (1 − α^(γ+1)) / (1 − α), and exactly γ + 1 at α = 1.

    Evaluated as the equal finite sum Σ_{i=0..γ} α^i, which is exact at α = 1
    and free of the cancellation the quotient suffers near α = 1.
    """
    alpha, gamma = check_alpha(alpha), check_gamma(gamma)
    return math.fsum(alpha**i for i in range(gamma + 1))


def expected_accepted(alpha: float, gamma: int) -> float:
    """E[n] = Σ_{i=1..γ} α^i: accepted drafts per round."""
    return expected_tokens(alpha, gamma) - 1.0


def alpha_from_acceptance_rate(rate: float, gamma: int) -> float:
    """Invert `acceptance rate = E[n] / γ` (accepted / drafted, as `engine.stats`
    reports it) to the per-draft α of the i.i.d. model. The rate is increasing
    in α from 0 (α = 0) to 1 (α = 1), so bisection finds the unique root."""
    rate, gamma = check_alpha(rate, name="acceptance_rate"), check_gamma(gamma)
    low, high = 0.0, 1.0
    for _ in range(80):
        mid = 0.5 * (low + high)
        if expected_accepted(mid, gamma) / gamma < rate:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """Wall-time speedup over plain decoding (Leviathan et al. Theorem 3.8 with
    the verification cost made explicit):

        speedup = E[tokens] / (γ·c + verify_cost)

    c: one draft step; verify_cost: one verification forward of γ+1 tokens, both
    in units of one plain target decode step. verify_cost = 1 is the
    memory-bound regime (γ+1 tokens cost what one does); verify_cost = γ+1 the
    compute-bound regime (cost proportional to tokens).
    """
    c = check_cost(c, "c")
    verify_cost = check_cost(verify_cost, "verify_cost", positive=True)
    return expected_tokens(alpha, gamma) / (gamma * c + verify_cost)


def optimal_gamma(alpha: float, c: float, verify_cost: VerifyCost = 1.0, max_gamma: int = 16) -> int:
    """The γ in 1..max_gamma that maximises `speedup(alpha, γ, c, verify_cost)`;
    the smallest such γ on ties. `verify_cost` is a float (the same for every
    γ) or a function γ -> cost, e.g. `lambda g: g + 1` for the compute-bound
    regime."""
    alpha = check_alpha(alpha)
    max_gamma = check_int(max_gamma, "max_gamma", minimum=1)
    cost_of = verify_cost if callable(verify_cost) else (lambda _gamma: verify_cost)
    best_gamma, best = 1, -math.inf
    for gamma in range(1, max_gamma + 1):
        value = speedup(alpha, gamma, c, cost_of(gamma))
        if value > best * (1.0 + 1e-12):
            best_gamma, best = gamma, value
    return best_gamma
