"""Argument checks shared by the simulator: each returns the value in its
canonical type or raises `ConfigError` naming the bad value and the valid range."""
from __future__ import annotations

import math
import numbers

from hybridspec.errors import ConfigError


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_alpha(alpha: object, name: str = "alpha") -> float:
    """α, the per-draft acceptance probability: a finite number in [0, 1]."""
    if not _is_real(alpha) or not math.isfinite(alpha) or not 0.0 <= alpha <= 1.0:
        raise ConfigError(
            f"{name}={alpha!r} is invalid: pass the per-draft acceptance probability, "
            f"a finite number in [0, 1]"
        )
    return float(alpha)


def check_int(value: object, name: str, minimum: int) -> int:
    """An integer count >= minimum (bools and non-integral floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: pass an integer >= {minimum}")
    return int(value)


def check_gamma(gamma: object) -> int:
    """γ, the drafts proposed per sequence per round: an integer >= 1."""
    return check_int(gamma, "gamma", minimum=1)


def check_snapshot_every(snapshot_every: object) -> int:
    """k of `CheckpointPolicy(snapshot_every=k)`: 0 (round start and final
    state only), 1 (every verify input) or k > 1 (inputs 0, k, 2k, ... and the last)."""
    return check_int(snapshot_every, "snapshot_every", minimum=0)


def check_cost(value: object, name: str, *, positive: bool = False) -> float:
    """A cost or a time: finite and >= 0 (> 0 when `positive`)."""
    bound_ok = _is_real(value) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not bound_ok:
        valid = "a finite number > 0" if positive else "a finite number >= 0"
        raise ConfigError(f"{name}={value!r} is invalid: pass {valid}")
    return float(value)
