"""`SamplingParams` and the one sampling rule of hybridspec.

Post-processing (applied identically to the target and to any drafter, so
that verification compares like with like): temperature, then top-k, then
top-p (nucleus), then min-p, then renormalise.

Sampling is Gumbel-max with noise keyed by (request seed, absolute position,
purpose): token = argmax_v log p(v) + g(seed, position, v). The same key gives
the same token whatever the batch composition, γ or drafter; this is what
makes `verify="coupled"` token-identical to plain decoding.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridspec.kernels.keyed_random import PURPOSE_SAMPLE, gumbel_argmax

from .errors import InvalidRequestError
from .validation import integer, real, token_id


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        checked = dict(
            max_new_tokens=integer("max_new_tokens", self.max_new_tokens, 1, InvalidRequestError),
            temperature=real("temperature", self.temperature, InvalidRequestError, ">= 0 (0 is greedy)"),
            top_k=integer("top_k", self.top_k, 0, InvalidRequestError, "; use 0 to turn it off"),
            top_p=real("top_p", self.top_p, InvalidRequestError, "in (0, 1]; use 1.0 to turn it off"),
            min_p=real("min_p", self.min_p, InvalidRequestError, "in [0, 1]; use 0.0 to turn it off"),
            seed=None if self.seed is None else integer("seed", self.seed, 0, InvalidRequestError, " or None"),
            stop_token_ids=_stop_token_ids(self.stop_token_ids))
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature={self.temperature!r} must be finite and >= 0 (0 is greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p={self.top_p!r} must be in (0, 1]; use 1.0 to turn it off")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p={self.min_p!r} must be in [0, 1]; use 0.0 to turn it off")
        if self.seed is not None and self.seed >= 2 ** 63:
            raise InvalidRequestError(f"seed={self.seed!r} must be an integer in [0, 2**63) or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else secrets.randbits(63)


def _stop_token_ids(values) -> tuple[int, ...]:
    """stop_token_ids as a tuple of ints: an iterable (not a string) of token ids."""
    example = "; pass an iterable of token ids such as (2,) or ()"
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRequestError(f"stop_token_ids={values!r} is not a collection of token ids{example}")
    ids = tuple(values)
    bad = [t for t in ids if token_id(t) is None or token_id(t) < 0]
    if bad:
        raise InvalidRequestError(f"stop_token_ids holds {bad[0]!r}, not a token id (an integer >= 0){example}")
    return tuple(token_id(t) for t in ids)


@dataclass
class RowParams:
    """SamplingParams of a batch as tensors, one row per sequence."""

    temperature: torch.Tensor  # [batch] float64 (0 for greedy rows)
    top_k: torch.Tensor  # [batch] int64
    top_p: torch.Tensor  # [batch] float64
    min_p: torch.Tensor  # [batch] float64
    seeds: torch.Tensor  # [batch] int64

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], device) -> "RowParams":
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)
        return cls(tensor([p.temperature for p in params], torch.float64),
                   tensor([p.top_k for p in params], torch.long),
                   tensor([p.top_p for p in params], torch.float64),
                   tensor([p.min_p for p in params], torch.float64),
                   tensor(seeds, torch.long))

    def select(self, rows: torch.Tensor) -> "RowParams":
        return RowParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                         self.seeds[rows])

    def repeat(self, n: int) -> "RowParams":
        """Each row repeated n times (for [batch, n, vocab] logits flattened)."""
        return RowParams(*(t.repeat_interleave(n) for t in
                           (self.temperature, self.top_k, self.top_p, self.min_p, self.seeds)))

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Post-processed probabilities. logits [N, vocab] -> probs [N, vocab] (float64).

    Greedy rows get the plain softmax (their argmax is all that is used).
    Filters no row asks for are skipped (sorting the vocabulary is the cost)."""
    x = logits.to(torch.float64)
    temperature = torch.where(rows.is_greedy, torch.ones_like(rows.temperature), rows.temperature)
    x = x / temperature[:, None]
    vocab = x.shape[-1]
    if bool((rows.top_k > 0).any()):  # keep the k largest logits (ties at the k-th value are kept)
        k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), torch.full_like(rows.top_k, vocab))
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    drop = None
    if bool((rows.top_p < 1).any()):  # keep the smallest prefix (by descending prob) whose mass reaches p
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = (mass_before >= rows.top_p[:, None]) & (rows.top_p < 1)[:, None]  # top_p = 1: off
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    if bool((rows.min_p > 0).any()):  # drop tokens below min_p times the top probability
        below = probs < rows.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        drop = below if drop is None else drop | below
    if drop is None:
        return probs
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, rows: RowParams, positions: torch.Tensor, purpose: int = PURPOSE_SAMPLE) -> torch.Tensor:
    """One token per row: argmax for greedy rows, keyed Gumbel-max otherwise.
    probs [N, vocab], positions [N] (absolute position of the sampled token) -> [N]."""
    greedy = probs.argmax(dim=-1)
    if bool(rows.is_greedy.all()):
        return greedy
    sampled = gumbel_argmax(probs, rows.seeds, positions, purpose)
    return torch.where(rows.is_greedy, greedy, sampled)
