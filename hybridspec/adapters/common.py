"""Shared helpers of the model adapters: renaming by rules, config reading."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from hybridspec.errors import UnsupportedModelError


def rename(state: dict[str, torch.Tensor], rules: list[tuple[str, str | None]]) -> dict[str, torch.Tensor]:
    """Map stored weight names to hybridspec's canonical names with regex rules
    (first match wins). A rule with replacement None drops a known non-weight
    (a rotary cache); names no rule matches are left out here and listed by
    `unmatched`, which the loaders reject."""
    out = {}
    for name, tensor in state.items():
        rule = _first_rule(name, rules)
        if rule is not None and rule[1] is not None:
            out[re.sub(rule[0], rule[1], name, count=1)] = tensor
    return out


def unmatched(state: dict[str, torch.Tensor], rules: list[tuple[str, str | None]]) -> list[str]:
    """The stored names no rule matches."""
    return [name for name in state if _first_rule(name, rules) is None]


def _first_rule(name: str, rules: list[tuple[str, str | None]]) -> tuple[str, str | None] | None:
    return next((rule for rule in rules if re.search(rule[0], name)), None)


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


@dataclass(frozen=True)
class LoadReport:
    """What a load found in the model directory besides the weights the model uses:
    `unused` maps each tensor that is present and deliberately left out (an
    adapter's `UNUSED` patterns, e.g. Qwen3-Next's MTP head `mtp.*`) to why.
    `HybridModel.load_report` after `hs.from_hf` / `hs.load`."""

    source: str
    unused: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.unused:
            return f"{self.source}: every tensor used"
        reasons = sorted(set(self.unused.values()))
        return f"{self.source}: {len(self.unused)} tensors present and unused ({'; '.join(reasons)})"


# a checkpoint's multi-token-prediction layer, in any family: not the target's, read by draft="mtp" (adapters/mtp.py)
MTP_UNUSED = [(r"^mtp\.", "multi-token-prediction (MTP) layer: not part of the target; draft='mtp' reads it")]


def set_aside(state: dict[str, torch.Tensor], patterns: list[tuple[str, str]],
              source: str) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """`state` without the tensors `patterns` (regex, reason) name, and the report naming them."""
    unused = {name: reason for name in state for pattern, reason in patterns
              if re.search(pattern, name)}
    return {n: t for n, t in state.items() if n not in unused}, LoadReport(source, unused)
