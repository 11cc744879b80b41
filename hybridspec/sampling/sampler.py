"""`SamplingParams` and the one sampling rule of hybridspec.

Post-processing (applied identically to the target and to any drafter, so
that verification compares like with like): the penalties (repetition, then
frequency and presence, `hybridspec.sampling.penalties`), temperature, then top-k,
then top-p (nucleus), then min-p, then renormalise.

Sampling is Gumbel-max with noise keyed by (request seed, absolute position,
purpose): token = argmax_v log p(v) + g(seed, position, v). The same key gives
the same token whatever the batch composition, γ or drafter; this is what
makes `verify="coupled"` token-identical to plain decoding.
"""
from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from hybridspec.kernels.backend import torch_threads
from hybridspec.kernels.keyed_random import PURPOSE_SAMPLE, gumbel_argmax

from hybridspec.deprecated import renamed_fields
from hybridspec.errors import InvalidRequestError
from hybridspec.sampling.structured import StructuredOutput
from hybridspec.validation import integer, real, token_id

if TYPE_CHECKING:
    from hybridspec.sampling.penalties import PenaltyContext

MAX_SEED = 2 ** 63


@renamed_fields({"cache_checkpoints": "save_states_at"})  # "checkpoint" names the ring snapshots
@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Every field is checked on construction
    (`InvalidRequestError` names the bad value and the fix).

    max_new_tokens: most tokens to generate (default 64; `max_tokens` in vLLM);
        0 ends the request right after its prefill with no token (finish
        reason "length"): scoring a prompt (`prompt_logprobs`), or warming the
        prefix cache.
    temperature: 0 (default) is greedy; > 0 samples softmax(logits / temperature).
    top_k: keep the k most likely tokens (0, the default: off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p,
        in (0, 1] (1.0, the default: off).
    min_p: drop tokens below min_p times the most likely token's probability,
        in [0, 1] (0.0, the default: off).
    seed: the request's sampling seed, an integer in [0, 2**63); None (default)
        draws a fresh one. A seeded request gives the same tokens alone or
        beside any others, plain or speculative at any γ (its rows are
        verified coupled; `Engine`'s `verify`). Sample i of n uses
        `hs.derived_seed(seed, i)`: the same request with n=1 and that seed
        gives sample i's tokens.
    n: samples per prompt (default 1); n > 1 needs temperature > 0.
    stop: strings that end the request; the output text is cut just before the
        first one (it may span tokens). Needs a detokenizer (`hs.LLM`, or
        `Engine(decode=...)`). Default: none.
    stop_token_ids: token ids that end the request, kept as its last token
        (default: none).
    ignore_eos: False (default) stops at the model's EOS token ids
        (`Engine.eos_token_ids`); True generates past them.
    logprobs: None (default) records none; k >= 0 records, for every generated
        token, its log-probability under the target's processed distribution
        (after penalties, temperature and filters) and the k most likely tokens'.
    prompt_logprobs: None (default) records none; k >= 0 records, for every
        prompt token but the first, its log-probability under the target's raw
        distribution after the tokens before it (log_softmax of the model's
        logits in at least float32: no penalties, temperature or filters, as
        vLLM's prompt log-probs), its rank and the k most likely tokens'
        (`Output.prompt_logprobs`; `hybridspec.sampling.logprobs`).
    repetition_penalty: > 0, 1.0 (default) is off. Every token of the prompt or
        the output has its logit divided by it when positive, multiplied when
        negative (Keskar et al. 2019; HF's `repetition_penalty`).
    presence_penalty: subtracted from the logit of every token generated so far
        (default 0.0; vLLM's and OpenAI's `presence_penalty`).
    frequency_penalty: subtracted from a token's logit once per time it was
        generated so far (default 0.0).
    structured: a `StructuredOutput` the output must match (a JSON object or
        schema, a regex, one of a list of strings, an EBNF grammar), or None
        (default). Needs the grammar engine (`pip install 'hybridspec[structured]'`).
        The grammar masks the target's logits (−inf outside the allowed tokens)
        before the penalties, temperature and filters, and the drafter's alike;
        the request ends where the grammar ends (`hybridspec.sampling.grammar`).
    save_states_at: prompt positions (token counts, 1..len(prompt)) where the
        prefix cache (`Engine(prefix_cache=...)`) saves the recurrent state, e.g.
        where a shared system prompt or document ends (default: none).
    The penalties read each position's own context (for a draft position, the
    drafts before it too), identically for target and drafter, so speculative
    decoding stays lossless with them.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a fresh random seed per request
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    save_states_at: tuple[int, ...] = ()
    structured: StructuredOutput | None = None

    def __post_init__(self):
        checked = dict(
            max_new_tokens=integer("max_new_tokens", self.max_new_tokens, 0, InvalidRequestError),
            temperature=real("temperature", self.temperature, InvalidRequestError, ">= 0 (0 is greedy)"),
            top_k=integer("top_k", self.top_k, 0, InvalidRequestError, "; use 0 to turn it off"),
            top_p=real("top_p", self.top_p, InvalidRequestError, "in (0, 1]; use 1.0 to turn it off"),
            min_p=real("min_p", self.min_p, InvalidRequestError, "in [0, 1]; use 0.0 to turn it off"),
            seed=None if self.seed is None else integer("seed", self.seed, 0, InvalidRequestError, " or None"),
            n=integer("n", self.n, 1, InvalidRequestError, " (samples per prompt)"),
            stop=_stop_strings(self.stop),
            stop_token_ids=_stop_token_ids(self.stop_token_ids),
            logprobs=None if self.logprobs is None else integer(
                "logprobs", self.logprobs, 0, InvalidRequestError, " (top tokens to record) or None"),
            prompt_logprobs=None if self.prompt_logprobs is None else integer(
                "prompt_logprobs", self.prompt_logprobs, 0, InvalidRequestError, " (top tokens to record) or None"),
            repetition_penalty=real("repetition_penalty", self.repetition_penalty, InvalidRequestError,
                                    "> 0; use 1.0 to turn it off"),
            presence_penalty=real("presence_penalty", self.presence_penalty, InvalidRequestError,
                                  "(finite); use 0.0 to turn it off"),
            frequency_penalty=real("frequency_penalty", self.frequency_penalty, InvalidRequestError,
                                   "(finite); use 0.0 to turn it off"),
            save_states_at=_save_states_at(self.save_states_at))
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(f"structured={self.structured!r} is not a StructuredOutput; build one with "
                                      "hs.StructuredOutput.json_schema(schema) (or .json_object(), .regex(pattern), "
                                      ".choice(strings), .grammar(ebnf)) or pass None")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature={self.temperature!r} must be finite and >= 0 (0 is greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p={self.top_p!r} must be in (0, 1]; use 1.0 to turn it off")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p={self.min_p!r} must be in [0, 1]; use 0.0 to turn it off")
        if self.seed is not None and self.seed >= MAX_SEED:
            raise InvalidRequestError(f"seed={self.seed!r} must be an integer in [0, 2**63) or None")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty={self.repetition_penalty!r} must be finite and > 0; "
                                      "use 1.0 to turn it off")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name}={getattr(self, name)!r} must be finite; use 0.0 to turn it off")
        if self.n > 1 and self.is_greedy:
            raise InvalidRequestError(f"n={self.n} with temperature=0 gives {self.n} identical greedy outputs; "
                                      "set temperature > 0 for distinct samples, or n=1")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else secrets.randbits(63)


def derived_seed(seed: int, sample: int) -> int:
    """The seed of sample `sample` (0 … n-1) of a request seeded `seed` with n
    samples: `seed` itself for sample 0 (so n=1 is unchanged), a hash of both
    for the others, in [0, 2**63). Noise is keyed by (seed, position), so the
    request with n=1 and `seed=hs.derived_seed(seed, i)` reproduces sample i's
    tokens exactly (plain or speculative: a seeded request is verified
    coupled)."""
    if sample == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED


def _stop_strings(values) -> tuple[str, ...]:
    """stop as a tuple of non-empty strings: one string or an iterable of them."""
    example = '; pass a string or a list of strings such as ["\\n\\n"]'
    if isinstance(values, str):
        values = (values,)
    if not isinstance(values, Iterable) or isinstance(values, bytes):
        raise InvalidRequestError(f"stop={values!r} is not a string or a collection of strings{example}")
    strings = tuple(values)
    bad = [s for s in strings if not isinstance(s, str) or not s]
    if bad:
        raise InvalidRequestError(f"stop holds {bad[0]!r}, not a non-empty string{example}")
    return strings


def _int_collection(name: str, values, minimum: int, what: str, example: str) -> tuple[int, ...]:
    """`values` as a tuple of ints >= minimum: an iterable (not a string) of `what`s."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRequestError(f"{name}={values!r} is not a collection of {what}s{example}")
    items = tuple(values)
    bad = [v for v in items if token_id(v) is None or token_id(v) < minimum]
    if bad:
        raise InvalidRequestError(f"{name} holds {bad[0]!r}, not a {what} (an integer >= {minimum}){example}")
    return tuple(token_id(v) for v in items)


def _save_states_at(values) -> tuple[int, ...]:
    """save_states_at as a sorted tuple of positions >= 1."""
    positions = _int_collection("save_states_at", values, 1, "position",
                                "; pass prompt positions (token counts) such as (512,) or ()")
    return tuple(sorted(set(positions)))


def _stop_token_ids(values) -> tuple[int, ...]:
    """stop_token_ids as a tuple of ints: an iterable (not a string) of token ids."""
    return _int_collection("stop_token_ids", values, 0, "token id", "; pass an iterable of token ids such as (2,) or ()")


@dataclass(frozen=True)
class RowFlags:
    """What some or all rows of a RowParams ask for, known on the host, so that
    the sampling path skips unused filters without reading tensors back. A
    subset of rows (`select`) keeps its parent's flags: "any" stays a safe
    over-approximation, "all" stays true."""

    all_greedy: bool
    any_greedy: bool
    any_temperature: bool  # some sampled row has a temperature other than 1
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @property
    def any_filter(self) -> bool:
        """Whether `process_logits` reads any row's tensors (besides penalties)."""
        return self.any_temperature or self.any_top_k or self.any_top_p or self.any_min_p

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "RowFlags":
        return cls(all(p.is_greedy for p in params), any(p.is_greedy for p in params),
                   any(not p.is_greedy and p.temperature != 1.0 for p in params),
                   any(p.top_k > 0 for p in params), any(p.top_p < 1 for p in params),
                   any(p.min_p > 0 for p in params))


ALL_FLAGS = RowFlags(False, True, True, True, True, True)  # nothing known: every filter is checked


@dataclass
class RowParams:
    """SamplingParams of a batch as tensors, one row per sequence."""

    temperature: torch.Tensor  # [batch] float64 (0 for greedy rows)
    top_k: torch.Tensor  # [batch] int64
    top_p: torch.Tensor  # [batch] float64
    min_p: torch.Tensor  # [batch] float64
    seeds: torch.Tensor  # [batch] int64
    repetition_penalty: torch.Tensor  # [batch] float64 (1: off)
    presence_penalty: torch.Tensor  # [batch] float64 (0: off)
    frequency_penalty: torch.Tensor  # [batch] float64 (0: off)
    flags: RowFlags = ALL_FLAGS  # host-side summary of the rows

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], device) -> "RowParams":
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)
        return cls(tensor([p.temperature for p in params], torch.float64),
                   tensor([p.top_k for p in params], torch.long),
                   tensor([p.top_p for p in params], torch.float64),
                   tensor([p.min_p for p in params], torch.float64),
                   tensor(seeds, torch.long),
                   tensor([p.repetition_penalty for p in params], torch.float64),
                   tensor([p.presence_penalty for p in params], torch.float64),
                   tensor([p.frequency_penalty for p in params], torch.float64),
                   RowFlags.of(params))

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "flags"]

    def select(self, rows: torch.Tensor) -> "RowParams":
        if rows.numel() == self.seeds.numel() and rows.numel() <= 1:  # the same single row (or none)
            return self
        return RowParams(*(t[rows] for t in self._tensors()), flags=self.flags)

    def repeat(self, n: int) -> "RowParams":
        """Each row repeated n times (for [batch, n, vocab] logits flattened)."""
        if n == 1:
            return self
        return RowParams(*(t.repeat_interleave(n) for t in self._tensors()), flags=self.flags)

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature == 0


def argmax_suffices(rows: RowParams, requests) -> bool:
    """Whether the rows' tokens are their logits' argmax and nothing else reads
    the probabilities: every row greedy, none with a penalty or asking for
    logprobs (softmax keeps the order, ties included; temperature does not
    apply to greedy rows and the filters keep the top token), so the float64
    `process_logits` can be skipped."""
    return rows.flags.all_greedy and all(r.params.logprobs is None and not r.params.has_penalties
                                         for r in requests)


def process_logits(logits: torch.Tensor, rows: RowParams, context: PenaltyContext | None = None) -> torch.Tensor:
    """Post-processed probabilities. logits [N, vocab] -> probs [N, vocab] (float64).

    `context` (`hybridspec.sampling.penalties.penalty_context`, None when no row has a
    penalty) holds each row's context token counts for the penalties.
    Greedy rows get the plain softmax of the penalised logits (their argmax is
    all that is used). Filters no row asks for are skipped (sorting the
    vocabulary is the cost), known from `rows.flags` without a readback."""
    flags = rows.flags
    x = logits.to(torch.float64)
    if context is not None:
        x = context.penalize(x, rows)
    if flags.any_temperature:
        temperature = torch.where(rows.is_greedy, torch.ones_like(rows.temperature), rows.temperature)
        x = x / temperature[:, None]
    vocab = x.shape[-1]
    if flags.any_top_k and bool((rows.top_k > 0).any()):  # keep the k largest logits (ties at the k-th value are kept)
        k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), torch.full_like(rows.top_k, vocab))
        with torch_threads():  # sorting the vocabulary splits well (an engine step runs torch on one thread)
            kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    drop = None
    if flags.any_top_p and bool((rows.top_p < 1).any()):  # keep the smallest prefix (by descending prob) whose mass reaches p
        with torch_threads():
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = (mass_before >= rows.top_p[:, None]) & (rows.top_p < 1)[:, None]  # top_p = 1: off
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    if flags.any_min_p and bool((rows.min_p > 0).any()):  # drop tokens below min_p times the top probability
        below = probs < rows.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        drop = below if drop is None else drop | below
    if drop is None:
        return probs
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, rows: RowParams, positions: torch.Tensor,
           purpose: int | torch.Tensor = PURPOSE_SAMPLE) -> torch.Tensor:
    """One token per row: argmax for greedy rows, keyed Gumbel-max otherwise.
    probs [N, vocab], positions [N] (absolute position of the sampled token),
    purpose (a PURPOSE_* int, or int64 [N]: one per row) -> [N]."""
    greedy = probs.argmax(dim=-1)
    if rows.flags.all_greedy or bool(rows.is_greedy.all()):
        return greedy
    sampled = gumbel_argmax(probs, rows.seeds, positions, purpose)
    return torch.where(rows.is_greedy, greedy, sampled)
