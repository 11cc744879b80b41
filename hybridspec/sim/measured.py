"""Round costs measured by the engine, and the speedup they imply.

`hybridspec simulate --measured FILE.json` reads this schema
(`hybridspec.round_cost/v1`), e.g. written by a bench from `engine.stats`:

    {
      "schema": "hybridspec.round_cost/v1",         required
      "machine": "1x H200",                          required, free text
      "model": "...", "draft": "...",                optional, free text
      "alpha": 0.78,                                 per-draft acceptance probability, or
      "acceptance_rate": 0.70,                       accepted / drafted (engine.stats);
                                                     exactly one of the two
      "gamma": 4,                                    required, drafts per round
      "tokens_per_round": 3.1,                       optional: emitted / rounds (engine.stats);
                                                     else E[tokens](alpha, gamma)
      "snapshot_every": 1, "log_inputs": false,      optional: the policy measured
      "batches": [                                   required, >= 1 entry, distinct batches
        {"batch": 1,
         "target_step_s": 0.0061,                    plain decode step (1 token per sequence)
         "draft_step_s": 0.0004,                     one drafter forward
         "verify_s": 0.0066,                         verify forward incl. snapshot and log writes
         "replay_s": 0.0,                            optional: mean replay time per round
         "draft_s": 0.0015,                          optional: the drafter's part of a round (catch-up
                                                     and gamma steps); missing = gamma * draft_step_s
         "sampling_s": 0.0002, "commit_s": 0.0001,   optional: the round's acceptance and commit
         "host_s": 0.0003,                           optional: the round's own bookkeeping
         "plain_sampling_s": 0.0001,                 optional: a plain step's sampling
         "plain_host_s": 0.0001}                     optional: a plain step's own bookkeeping
      ]                                              optional terms missing = assumed 0
    }

The speedup is `hs.sim.round_speedup`: tokens_per_round · round(B, 0) / round(B, γ),
each round the sum of its `RoundTerms` (`hybridspec.costs.round_terms`).

Times are seconds for the whole batch. A figure computed only from measured
inputs is labelled measured; one that uses any assumed input is labelled assumed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hybridspec.errors import ConfigError
from hybridspec.costs.closed_form import alpha_from_acceptance_rate, expected_tokens
from hybridspec.costs.round_terms import TERMS, RoundTerms, round_speedup
from hybridspec.costs.validation import check_alpha, check_cost, check_gamma, check_int, check_snapshot_every

SCHEMA = "hybridspec.round_cost/v1"
MEASURED, ASSUMED = "measured", "assumed"


def figure(value: Any, source: str) -> dict:
    """A number with its provenance, as it appears in the JSON output."""
    return {"value": value, "source": source}


# optional per-batch fields: (name in the file, the term it gives, of the plain step or the round)
OPTIONAL_TERMS = (("replay_s", "replay_s", False), ("sampling_s", "sampling_s", False),
                  ("commit_s", "commit_s", False), ("host_s", "host_s", False),
                  ("plain_sampling_s", "sampling_s", True), ("plain_host_s", "host_s", True))


@dataclass(frozen=True)
class MeasuredBatch:
    batch: int
    target_step_s: float
    draft_step_s: float
    verify_s: float
    replay_s: float
    replay_source: str  # MEASURED, or ASSUMED when the file left replay_s out
    plain: RoundTerms  # a plain step's terms
    round: RoundTerms  # a round's terms (the drafter's: draft_s, else γ · draft_step_s)
    sources: dict  # "plain <term>" / "round <term>" -> MEASURED or ASSUMED (0 because the file left it out)


@dataclass(frozen=True)
class MeasuredRun:
    machine: str
    model: str
    draft: str
    alpha: float
    alpha_note: str
    gamma: int
    tokens_per_round: float
    tokens_note: str
    snapshot_every: Optional[int]
    log_inputs: Optional[bool]
    batches: tuple[MeasuredBatch, ...]  # ascending batch


def _field(data: dict, key: str, where: str) -> Any:
    if key not in data:
        raise ConfigError(f"{where}: missing required field {key!r}; see the schema in docs/simulator.md")
    return data[key]


def _parse_batch(entry: Any, index: int, gamma: int) -> MeasuredBatch:
    where = f"batches[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}={entry!r} is invalid: pass an object with batch and step times")
    times = {
        key: check_cost(_field(entry, key, where), f"{where}.{key}", positive=True)
        for key in ("target_step_s", "verify_s")
    }
    draft_step = check_cost(_field(entry, "draft_step_s", where), f"{where}.draft_step_s")
    plain, spec = {"forward_s": times["target_step_s"]}, {"forward_s": times["verify_s"]}
    draft = entry.get("draft_s")
    spec["draft_s"] = gamma * draft_step if draft is None else check_cost(draft, f"{where}.draft_s")
    sources = {f"{kind} {term}": MEASURED for kind, terms in (("plain", plain), ("round", spec)) for term in terms}
    for key, term, of_plain in OPTIONAL_TERMS:
        value = check_cost(entry[key], f"{where}.{key}") if key in entry else 0.0
        (plain if of_plain else spec)[term] = value
        sources[f"{'plain' if of_plain else 'round'} {term}"] = MEASURED if key in entry else ASSUMED
    return MeasuredBatch(
        batch=check_int(_field(entry, "batch", where), f"{where}.batch", minimum=1),
        draft_step_s=draft_step,
        replay_s=spec["replay_s"],
        replay_source=sources["round replay_s"],
        plain=RoundTerms(**plain),
        round=RoundTerms(**spec),
        sources=sources,
        **times,
    )


def _parse_alpha(data: dict, gamma: int) -> tuple[float, str]:
    has_alpha, has_rate = "alpha" in data, "acceptance_rate" in data
    if has_alpha == has_rate:
        raise ConfigError("measured file: give exactly one of 'alpha' and 'acceptance_rate'")
    if has_alpha:
        return check_alpha(data["alpha"]), "measured alpha"
    rate = check_alpha(data["acceptance_rate"], name="acceptance_rate")
    return alpha_from_acceptance_rate(rate, gamma), f"from measured acceptance_rate={rate:g}"


def parse_measured(data: Any) -> MeasuredRun:
    """Validate a decoded `hybridspec.round_cost/v1` document."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"measured file: schema={found!r}; expected {SCHEMA!r}")
    gamma = check_gamma(_field(data, "gamma", "measured file"))
    alpha, alpha_note = _parse_alpha(data, gamma)
    if "tokens_per_round" in data:
        tokens = check_cost(data["tokens_per_round"], "tokens_per_round")
        if not 1.0 <= tokens <= gamma + 1:
            raise ConfigError(f"tokens_per_round={tokens!r} is invalid: pass a number in [1, gamma + 1 = {gamma + 1}]")
        tokens_note = "measured tokens_per_round"
    else:
        tokens, tokens_note = expected_tokens(alpha, gamma), "E[tokens] of the measured alpha"
    entries = _field(data, "batches", "measured file")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("measured file: 'batches' must be a non-empty list of objects")
    batches = tuple(sorted((_parse_batch(entry, i, gamma) for i, entry in enumerate(entries)), key=lambda b: b.batch))
    sizes = [b.batch for b in batches]
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"measured file: batch sizes {sizes} repeat; give one entry per batch size")
    snapshot_every = data.get("snapshot_every")
    log_inputs = data.get("log_inputs")
    if log_inputs is not None and not isinstance(log_inputs, bool):
        raise ConfigError(f"log_inputs={log_inputs!r} is invalid: pass true or false")
    return MeasuredRun(
        machine=str(_field(data, "machine", "measured file")),
        model=str(data.get("model", "")),
        draft=str(data.get("draft", "")),
        alpha=alpha,
        alpha_note=alpha_note,
        gamma=gamma,
        tokens_per_round=tokens,
        tokens_note=tokens_note,
        snapshot_every=None if snapshot_every is None else check_snapshot_every(snapshot_every),
        log_inputs=log_inputs,
        batches=batches,
    )


def load_measured(path: str | Path) -> MeasuredRun:
    """Read and validate a `hybridspec.round_cost/v1` JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"--measured {path}: no such file; pass the JSON a bench wrote") from error
    except json.JSONDecodeError as error:
        raise ConfigError(f"--measured {path}: not valid JSON ({error})") from error
    return parse_measured(data)


def measured_rows(run: MeasuredRun) -> list[dict]:
    """Per batch: c, verify and replay cost (in plain steps), every term of the
    plain step and of the round (seconds), and the speedup
    `round_speedup(tokens_per_round, plain, round)`, labelled."""
    rows = []
    for entry in run.batches:
        speedup_source = ASSUMED if ASSUMED in entry.sources.values() else MEASURED
        rows.append({
            "batch": entry.batch,
            "target_step_s": figure(entry.target_step_s, MEASURED),
            "c": figure(entry.draft_step_s / entry.target_step_s, MEASURED),
            "verify_cost": figure(entry.verify_s / entry.target_step_s, MEASURED),
            "replay_cost": figure(entry.replay_s / entry.target_step_s, entry.replay_source),
            "terms": {f"{kind} {term}": figure(getattr(terms, term), entry.sources.get(f"{kind} {term}", MEASURED))
                      for kind, terms in (("plain", entry.plain), ("round", entry.round)) for term in TERMS},
            "speedup": figure(round_speedup(run.tokens_per_round, entry.plain, entry.round), speedup_source),
        })
    return rows


def measured_crossover(rows: list[dict]) -> dict:
    """Where the measured speedup falls to 1: interpolated linearly between the
    two measured batches around the sign change, or a bound when it is outside."""
    points = [(row["batch"], row["speedup"]["value"]) for row in rows]
    source = ASSUMED if any(row["speedup"]["source"] == ASSUMED for row in rows) else MEASURED
    if points[0][1] <= 1.0:
        return {"batch": None, "bracket": [None, points[0][0]], "source": source,
                "note": f"no gain already at the smallest measured batch {points[0][0]}"}
    for (low, gain_low), (high, gain_high) in zip(points, points[1:]):
        if gain_high <= 1.0:
            crossing = low + (gain_low - 1.0) * (high - low) / (gain_low - gain_high)
            return {"batch": math.ceil(crossing), "bracket": [low, high], "source": source,
                    "note": f"between measured batches {low} and {high} (linear interpolation)"}
    return {"batch": None, "bracket": [points[-1][0], None], "source": source,
            "note": f"still a gain at the largest measured batch {points[-1][0]}"}
