"""`RoundCosts`: the terms of a round measured at an engine's start-up
(`hybridspec.engine.startup_costs`), per measured batch size and token count, and
read between them (linear); the batch sizes an engine's table holds
(`measured_batches`) and the fewer start-up times (`anchor_batches`), the
rest read between and past them (`RoundCosts.resampled`). Adaptive γ
(`spec/gamma.py`) prices its rounds from them."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridspec.costs.checkpoint_costs import interpolate
from hybridspec.costs.round_terms import RoundTerms

from hybridspec.errors import ConfigError

if TYPE_CHECKING:  # a policy's replay price is handed in; costs sit below the checkpoint policies
    from hybridspec.checkpoints.auto import ReplayPrice

Table = tuple[tuple[float, ...], ...]  # [batch][tokens] seconds


@dataclass(frozen=True)
class RoundCosts:
    """Seconds measured on this engine's models (`hybridspec.engine.startup_costs`),
    per batch size in `batches` and token count T = G + 1 in `tokens` (T = 1:
    a plain decode step), the terms of `hs.sim.RoundTerms`:
    forward_s[i][j]: the target forward of tokens[j] inputs per row at
    batches[i] rows, with the engine's snapshot writes; draft_s: the drafter's
    part of a round drafting tokens[j] − 1 per row (catch-up and steps);
    sampling_s, commit_s, host_s: the round's acceptance, commit and own
    bookkeeping (a plain step's sampling and row results at T = 1).
    draft_step_s[i]: one drafter step, which prices G steps as G · draft_step
    where `draft_s` is not given (None); row_draft_s[i]: what one more draft
    of one row adds beyond the padded forward (its snapshot write);
    absorb_s[i]: seconds per token of a model drafter's backlog forward.
    replay: the expected replay of the engine's checkpoint policy, by batch,
    G and acceptance (the commit terms leave replays out).
    sampled_sampling_s, sampled_draft_s: the sampling and draft terms of rounds
    whose rows all sample (temperature 1: the rejection kernel, the drafter's q
    and sampled drafts) where the others are of greedy rows (None: as greedy).
    A term given as None is 0 (not measured; absorb_s: learned online)."""

    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    forward_s: Table
    draft_step_s: tuple[float, ...]
    row_draft_s: tuple[float, ...]
    draft_s: Table | None = None
    sampling_s: Table | None = None
    commit_s: Table | None = None
    host_s: Table | None = None
    absorb_s: tuple[float, ...] | None = None
    sampled_sampling_s: Table | None = None
    sampled_draft_s: Table | None = None
    replay: ReplayPrice | None = None  # the policy's expected replay at an acceptance (None: it never replays)

    def __post_init__(self):
        tables = [t for t in (self.forward_s, self.draft_s, self.sampling_s, self.commit_s, self.host_s,
                              self.sampled_sampling_s, self.sampled_draft_s) if t is not None]
        ok = (self.batches and list(self.batches) == sorted(set(self.batches)) and self.tokens
              and list(self.tokens) == sorted(set(self.tokens))
              and all(len(t) == len(self.batches) and all(len(row) == len(self.tokens) for row in t) for t in tables)
              and len(self.draft_step_s) == len(self.row_draft_s) == len(self.batches)
              and (self.absorb_s is None or len(self.absorb_s) == len(self.batches)))
        values = [v for t in tables for row in t for v in row] + list(self.draft_step_s) + list(self.row_draft_s) \
            + list(self.absorb_s or ())
        if not ok or any(not math.isfinite(v) or v < 0 for v in values):
            raise ConfigError("RoundCosts needs ascending batches and tokens, one time per (batch, tokens) in each "
                              "term and one draft step and row draft time per batch, all finite seconds >= 0")

    def _at(self, table: Table | None, batch: int, tokens: int) -> float:
        if table is None:
            return 0.0
        per_batch = [interpolate(self.tokens, row, tokens) for row in table]
        return interpolate(self.batches, per_batch, batch)

    def forward(self, batch: int, tokens: int) -> float:
        return self._at(self.forward_s, batch, tokens)

    def draft_step(self, batch: int) -> float:
        return interpolate(self.batches, self.draft_step_s, batch)

    def row_draft(self, batch: int) -> float:
        return interpolate(self.batches, self.row_draft_s, batch)

    def absorb(self, batch: int) -> float | None:
        """Seconds per token a model drafter absorbs at `batch` (None: not measured)."""
        return None if self.absorb_s is None else interpolate(self.batches, self.absorb_s, batch)

    def terms(self, batch: int, G: int, sampled: bool = False) -> RoundTerms:
        """The measured terms of a round of `batch` rows drafting G each (G = 0:
        a plain step), every row greedy or (`sampled`) every row sampling."""
        T = G + 1
        draft_s, sampling_s = self.draft_s, self.sampling_s
        if sampled:
            draft_s = self.sampled_draft_s if self.sampled_draft_s is not None else draft_s
            sampling_s = self.sampled_sampling_s if self.sampled_sampling_s is not None else sampling_s
        draft = 0.0 if G == 0 else (G * self.draft_step(batch) if draft_s is None else self._at(draft_s, batch, T))
        return RoundTerms(forward_s=self.forward(batch, T), draft_s=draft,
                          sampling_s=self._at(sampling_s, batch, T),
                          commit_s=0.0 if G == 0 else self._at(self.commit_s, batch, T),
                          host_s=self._at(self.host_s, batch, T))

    def resampled(self, batches) -> "RoundCosts":
        """These costs at `batches` (ascending): each term read at every batch
        as `terms` reads it (linear between the measured batches, extended
        linearly past them, clamped at 0), so a table timed at a few batches
        keeps one bucket of online corrections per batch of `batches`."""
        batches = tuple(batches)

        def table(values: Table | None) -> Table | None:
            if values is None:
                return None
            columns = list(zip(*values))  # [tokens][batch]
            return tuple(tuple(interpolate(self.batches, column, b) for column in columns) for b in batches)

        def per_batch(values: tuple[float, ...] | None) -> tuple[float, ...] | None:
            return None if values is None else tuple(interpolate(self.batches, values, b) for b in batches)

        return dataclasses.replace(
            self, batches=batches, forward_s=table(self.forward_s), draft_step_s=per_batch(self.draft_step_s),
            row_draft_s=per_batch(self.row_draft_s), draft_s=table(self.draft_s), sampling_s=table(self.sampling_s),
            commit_s=table(self.commit_s), host_s=table(self.host_s), absorb_s=per_batch(self.absorb_s),
            sampled_sampling_s=table(self.sampled_sampling_s), sampled_draft_s=table(self.sampled_draft_s))

    def bucket(self, batch: int) -> int:
        """Index of the measured batch nearest to `batch` (where online corrections are kept)."""
        return min(range(len(self.batches)), key=lambda i: abs(self.batches[i] - batch))


def measured_batches(max_batch_size: int) -> list[int]:
    """Batch sizes measured at start-up: powers of two up to the concurrency limit, and the limit."""
    batches, b = [], 1
    while b < max_batch_size:
        batches.append(b)
        b *= 2
    return batches + [max_batch_size]


ANCHORS = (1, 8)  # batch sizes start-up times: the rest of a table is read between and past them


def anchor_batches(max_batch_size: int) -> list[int]:
    """Batch sizes start-up times for an engine of `max_batch_size` rows: the
    `ANCHORS` below it and the limit, at most the largest anchor. A round's
    terms grow about linearly in the batch; what a larger batch costs beyond
    the line, the controller learns online per batch size (`spec/gamma.py`:
    the forward's scale apart for plain steps and rounds, the residual, and
    each kind of round's measured goodput), where timing batch 32 at start-up
    would cost seconds every first start."""
    top = min(max_batch_size, ANCHORS[-1])
    return sorted({b for b in ANCHORS if b < top} | {top})
