"""`Engine`: plain and speculative generation over a `HybridModel`.

`Engine(target)` is plain autoregressive decoding through the same runtime:
the baseline every benchmark compares against. With `draft=` it runs
speculative rounds (`hybridspec.spec.speculator`): draft → verify → commit.
The Engine builds the pieces a `Speculator` receives (drafter, bound
checkpoint policy, target cache, stats); docs/design.md draws the whole.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Callable, Literal

import torch
from tqdm.auto import tqdm

from hybridspec.checkpoints.auto import resolve_policy
from hybridspec.checkpoints.policy import validate_gamma
from hybridspec.state_memory import default_state_dtype

from .cache.hybrid_cache import HybridCache, scratch_cache
from .cache.prefix_cache import PrefixCache, PrefixStore, as_prefix_settings
from .errors import ConfigError, InvalidRequestError
from .logprobs import TokenLogprob, batch_logprobs
from .models.hybrid import HybridModel
from .penalties import penalty_context
from .requests import engine_eos_ids, engine_sizes, normalize_requests
from .sampling import RowParams, SamplingParams, derived_seed, process_logits, sample
from .spec.drafters import as_drafter
from .spec.speculator import Speculator
from .stats import EngineStats
from .stopping import Decode, StopRule


@dataclass
class Output:
    """What `Engine.generate` returns for one prompt (and sample).

    prompt_token_ids: the prompt as given.
    token_ids: the generated tokens only, the stop token (if any) included.
    finish_reason: "stop" (a stop token, EOS or stop string) or "length"
        (max_new_tokens reached).
    stop_reason: the stop token id or stop string that ended it; None for EOS
        and for "length" (vLLM's convention).
    logprobs: with `SamplingParams(logprobs=k)`, one `TokenLogprob` per
        generated token; None otherwise.
    sample_index: which of the prompt's n samples this is (0 for n=1).
    """

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    sample_index: int = 0


@dataclass
class Request:
    """One sequence being generated: committed tokens = prompt + output."""

    seq_id: int
    params: SamplingParams
    seed: int
    output: Output
    stops: StopRule
    on_emit: Callable[[list[int]], None] | None = None  # called with the tokens each emit keeps

    @property
    def committed_len(self) -> int:
        return len(self.output.prompt_token_ids) + len(self.output.token_ids)

    @property
    def last_token(self) -> int:
        return self.output.token_ids[-1] if self.output.token_ids else self.output.prompt_token_ids[-1]

    def would_keep(self, tokens: list[int]) -> int:
        """How many of `tokens` `emit` would keep: up to and including the token
        that ends the request (stop token, EOS, stop string, max_new_tokens)."""
        return self.stops.cut(self.output.token_ids, [int(t) for t in tokens]).kept

    def would_finish(self, tokens: list[int]) -> bool:
        """Whether emitting `tokens` ends the request."""
        return self.stops.cut(self.output.token_ids, [int(t) for t in tokens]).finished

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Append the kept prefix of `tokens` (the rest of a round is cut) and
        of their `logprobs`; set finish_reason and stop_reason when it ends."""
        tokens = [int(t) for t in tokens]
        cut = self.stops.cut(self.output.token_ids, tokens)
        self.output.token_ids.extend(tokens[:cut.kept])
        if logprobs is not None:
            self.output.logprobs = (self.output.logprobs or []) + logprobs[:cut.kept]
        if self.on_emit is not None and cut.kept:
            self.on_emit(tokens[:cut.kept])
        if cut.finished:
            self.output.finish_reason, self.output.stop_reason = cut.finish_reason, cut.stop_reason
        return cut.kept

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


class Engine:
    """Plain or speculative generation of token ids over a `HybridModel`
    (`hs.LLM` is the text-level front end built on it).

    target: the model whose distribution is sampled (`hs.from_hf`, `hs.load`).
    draft: None (default: plain decoding, the baseline), a HybridModel sharing
        the target's vocabulary, `hs.NgramDrafter()`, or any
        `hybridspec.spec.Drafter`.
    num_draft_tokens: γ, drafts per sequence per round (default 4; >= 1).
    checkpoint: how the target's recurrent state is snapshotted during
        verification: a `CheckpointPolicy`, "auto" (`AutoCheckpointPolicy`),
        or None (default: a snapshot after every verify input).
    verify: "rejection" (default: lossless rejection sampling) or "coupled"
        (output token-identical to plain decoding with the same seed).
    max_batch_size: most sequences per `generate` call, samples counted
        (default 16).
    max_model_len: most tokens (prompt + generated) per sequence (default: the
        model's limit, at most 4096).
    block_size: tokens per KV page (default 16); num_blocks: KV pages in the
        pool (default: max_model_len tokens for every sequence).
    state_dtype: dtype of SSM states and conv windows (default None: float32,
        float64 for a float64 model).
    eos_token_ids: token ids that end a request unless its `ignore_eos` is set
        (default None: the target config's `eos_token_id`, if any).
    decode: token ids -> text, needed by requests with `stop` strings (default
        None; `hs.LLM` passes its tokenizer's).
    prefix_cache: reuse cached prefixes across requests and `generate` calls
        (attention K/V pages shared, recurrent state from the nearest state
        checkpoint, the tail replayed; `hybridspec.cache.prefix_cache`): True
        for the defaults, an `hs.PrefixCache(...)` for settings, or None / False
        (default: off). A model drafter gets a prefix cache of its own.

    After each `generate`, `stats` (`EngineStats`) describes that call alone;
    `total_stats` adds up every call of this Engine.
    """

    def __init__(self, target: HybridModel, draft=None, num_draft_tokens: int = 4, checkpoint=None,
                 verify: Literal["rejection", "coupled"] = "rejection", *, max_batch_size: int = 16,
                 max_model_len: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 state_dtype: torch.dtype | None = None, eos_token_ids: Iterable[int] | None = None,
                 decode: Decode | None = None, prefix_cache: bool | PrefixCache | None = None):
        if not isinstance(target, HybridModel):
            raise ConfigError(f"target must be a HybridModel (from hs.from_hf or hs.load), got {type(target).__name__}")
        if verify not in ("rejection", "coupled"):
            raise ConfigError(f"verify={verify!r} must be 'rejection' or 'coupled'")
        if state_dtype is not None and not (isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point):
            raise ConfigError(f"state_dtype={state_dtype!r} must be a floating torch.dtype (e.g. torch.float32) "
                              "or None for the default")
        if decode is not None and not callable(decode):
            raise ConfigError(f"decode={decode!r} must be a function from token ids to text, e.g. tokenizer.decode")
        prefix_settings = as_prefix_settings(prefix_cache)
        self.eos_token_ids = engine_eos_ids(target.config, eos_token_ids)
        self.decode = decode
        sizes = engine_sizes(target.config, max_batch_size, max_model_len, block_size, num_blocks)
        self.target = target
        self.verify = verify
        self.max_model_len = sizes.max_model_len
        self.max_batch_size = sizes.max_batch_size
        self.state_dtype = state_dtype or default_state_dtype(target.dtype)
        self.cache_kwargs = dict(max_seqs=sizes.max_batch_size, block_size=sizes.block_size,
                                 num_blocks=sizes.num_blocks, dtype=target.dtype, device=target.device)
        self.stats = EngineStats()
        self.total_stats = EngineStats()
        self.check_invariants = os.environ.get("HYBRIDSPEC_CHECK", "0") not in ("", "0")
        self.speculator: Speculator | None = None
        if draft is None:
            self.cache = self._new_cache(ring_slots=2)
        else:
            validate_gamma(num_draft_tokens)
            policy = resolve_policy(checkpoint).bind(  # "auto" measures step costs here
                target, num_draft_tokens, max_batch_size=self.max_batch_size, state_dtype=self.state_dtype,
                new_cache=functools.partial(scratch_cache, target, state_dtype=self.state_dtype))
            drafter = as_drafter(draft, target, num_draft_tokens, self.cache_kwargs, prefix_settings)
            self.cache = self._new_cache(ring_slots=policy.ring_size(num_draft_tokens))
            self.speculator = Speculator(target, drafter, num_draft_tokens, policy, self.cache, self.stats,
                                         coupled=verify == "coupled", check_invariants=self.check_invariants,
                                         release=self._release)
        self.prefix = None if prefix_settings is None else PrefixStore(target, self.cache, prefix_settings)
        self._next_seq_id = 0

    def _new_cache(self, ring_slots: int) -> HybridCache:
        """The target's cache with this engine's sizes."""
        return HybridCache(self.target.config, ring_slots=ring_slots, state_dtype=self.state_dtype,
                           **self.cache_kwargs)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | str = False, stream: Callable[[int, list[int]], None] | None = None) -> list[Output]:
        """Generate for every prompt; returns one Output per prompt, in order, or
        with `n` > 1 n consecutive Outputs per prompt (HF's
        `num_return_sequences` order), sample i seeded `derived_seed(seed, i)`.

        prompts: token-id lists (or 1-D integer arrays / tensors).
        params: one SamplingParams for all prompts, one per prompt, or None (the
            defaults: 64 greedy tokens).
        progress: a tqdm bar on stderr (a string labels it); default off.
        stream: when given, `stream(i, token_ids)` is called as tokens of
            output i are emitted (once per round, after its commit).
        Raises InvalidRequestError / CacheFullError before anything runs."""
        prompts, params = normalize_requests(prompts, params, self.target.vocab_size, self.max_batch_size,
                                             self.max_model_len)
        if self.decode is None and any(p.stop for p in params):
            raise InvalidRequestError("stop strings need a detokenizer: use hs.LLM for text, or build the Engine "
                                      "with decode=tokenizer.decode (or pass stop_token_ids instead)")
        requests = self._requests(prompts, params, stream)
        kv_lens = {r.seq_id: len(r.output.prompt_token_ids) + r.params.max_new_tokens for r in requests}
        if self.prefix is not None:  # cached pages give way; each request may copy two shared pages on write
            self.prefix.make_room(sum(-(-n // self.cache.block_size) + 2 for n in kv_lens.values()))
        self.cache.check_admission(len(requests), kv_lens)
        if self.speculator is not None:
            self.speculator.drafter.check_admission(requests)
        self.stats.reset()
        rows = RowParams.of([r.params for r in requests], [r.seed for r in requests], self.target.device)
        bar = tqdm(total=sum(r.params.max_new_tokens for r in requests), disable=not progress, unit="tok",
                   desc=progress if isinstance(progress, str) else None, leave=False)
        try:
            self._prefill(requests, rows)
            bar.update(len(requests))
            loop = self.speculator.run if self.speculator is not None else self._decode_loop
            loop(requests, rows, bar)
        finally:
            self._release(requests)
            if self.speculator is not None:
                self.speculator.drafter.release([r.seq_id for r in requests])
            if self.prefix is not None:
                self.prefix.move_counts(self.stats)
            bar.close()
            self.total_stats.add(self.stats)
        return [r.output for r in requests]

    def _requests(self, prompts: list[list[int]], params: list[SamplingParams], stream) -> list[Request]:
        """One Request per prompt and sample, with fresh sequence ids."""
        requests = []
        for prompt, p in zip(prompts, params):
            seed = p.resolved_seed()
            stops = StopRule(p.max_new_tokens, frozenset(p.stop_token_ids),
                             frozenset() if p.ignore_eos else self.eos_token_ids, p.stop, self.decode)
            for sample_index in range(p.n):
                i = len(requests)
                on_emit = None if stream is None else (lambda tokens, i=i: stream(i, tokens))
                output = Output(list(prompt), logprobs=None if p.logprobs is None else [], sample_index=sample_index)
                requests.append(Request(self._next_seq_id, p, derived_seed(seed, sample_index), output, stops,
                                        on_emit))
                self._next_seq_id += 1
        return requests

    def _prefill(self, requests: list[Request], rows: RowParams) -> None:
        """Absorb every prompt and emit the first token from the last prompt logits."""
        ids, prompts = [r.seq_id for r in requests], [r.output.prompt_token_ids for r in requests]
        if self.prefix is None:
            logits = self.target.prefill(self.cache, ids, prompts, last_only=True)[:, 0]  # [batch, vocab]
            self.stats.prefill_computed_tokens += sum(map(len, prompts))
        else:
            logits = self.prefix.prefill(ids, prompts, [r.params.cache_checkpoints for r in requests])
        self.stats.sequences += len(requests)
        self._sample_and_emit(requests, logits, rows)

    def _release(self, requests: list[Request]) -> None:
        """Requests leave the target's cache; with the prefix cache on, a finished
        one's committed tokens stay indexed (an unfinished one was aborted)."""
        if self.prefix is not None:
            self.prefix.release([r.seq_id for r in requests],
                                [r.output.prompt_token_ids + r.output.token_ids if r.finished else None
                                 for r in requests])
        self.cache.free_sequences([r.seq_id for r in requests])

    def _sample_and_emit(self, requests: list[Request], logits: torch.Tensor, rows: RowParams) -> None:
        with self.stats.phase("sampling"):
            positions = torch.tensor([r.committed_len for r in requests], device=logits.device)
            probs = process_logits(logits, rows, penalty_context(requests, logits.shape[-1], logits.device))
            tokens = sample(probs, rows, positions).tolist()
            logprobs = batch_logprobs(probs[:, None], [[t] for t in tokens], requests)
        for r, t, lp in zip(requests, tokens, logprobs):
            r.emit([t], lp)
        self.stats.emitted_tokens += len(requests)

    def _decode_loop(self, requests: list[Request], rows: RowParams, bar) -> None:
        """Plain decoding: one target step per token for every unfinished sequence."""
        index = {r.seq_id: i for i, r in enumerate(requests)}
        active = [r for r in requests if not r.finished]
        while active:
            self._release([r for r in active if r.finished])
            with self.stats.phase("verify"):
                logits = self.target.decode(self.cache, [r.seq_id for r in active], [r.last_token for r in active])
            select = torch.tensor([index[r.seq_id] for r in active], device=logits.device)
            self._sample_and_emit(active, logits, rows.select(select))
            if self.check_invariants:
                for r in active:
                    self.cache.check_invariant(r.seq_id, r.committed_len)
            self.stats.rounds += 1
            self.stats.sequence_rounds += len(active)
            bar.update(len(active))
            active = [r for r in active if not r.finished]
