"""Checks of single user-supplied values: integers, real numbers, token ids.

An integer is a Python int or a numpy integer scalar; a token id may also be
a 0-d integer torch tensor (what iterating over a 1-D tensor yields). A bool
is never an integer here, though Python counts it as one: `True` as a token id
or a length is a slip, not a 1. Each check returns the plain Python value or
raises the given typed error naming the value and what was expected.
"""
from __future__ import annotations

import numbers

import torch

from hybridspec.errors import HybridSpecError

INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(name: str, value, minimum: int, error: type[HybridSpecError], fix: str = "") -> int:
    """int(value) if it is an integer >= minimum, else `error`."""
    if not is_integer(value) or value < minimum:
        kind = ", not a bool" if isinstance(value, bool) else ""
        raise error(f"{name}={value!r} must be an integer >= {minimum}{kind}{fix}")
    return int(value)


def real(name: str, value, error: type[HybridSpecError], expected: str) -> float:
    """float(value) if it is a real number (not a bool), else `error`."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise error(f"{name}={value!r} must be a number {expected}")
    return float(value)


def token_id(value) -> int | None:
    """The token id `value` holds as an int, or None if it holds none (range not checked)."""
    if isinstance(value, torch.Tensor):
        return int(value) if value.ndim == 0 and value.dtype in INTEGER_DTYPES else None
    return int(value) if is_integer(value) else None
