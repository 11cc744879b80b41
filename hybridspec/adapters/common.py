"""Shared helpers of the checkpoint adapters: renaming by rules, config reading."""
from __future__ import annotations

import re

import torch

from ..errors import UnsupportedModelError


def rename(state: dict[str, torch.Tensor], rules: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Map checkpoint names to hybridspec's canonical names with regex rules
    (first match wins). Names that no rule matches are dropped on purpose
    (rotary caches, training-only buffers)."""
    out = {}
    for name, tensor in state.items():
        for pattern, repl in rules:
            new, count = re.subn(pattern, repl, name)
            if count:
                out[new] = tensor
                break
    return out


def rope_settings(cfg: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from an HF config dict (5.x
    `rope_parameters` or the older top-level keys)."""
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def eos_id(cfg: dict) -> int | None:
    eos = cfg.get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos
