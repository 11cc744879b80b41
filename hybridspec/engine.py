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
from typing import Callable, Literal

import torch
from tqdm.auto import tqdm

from hybridspec.checkpoints.auto import resolve_policy
from hybridspec.checkpoints.policy import validate_gamma
from hybridspec.state_memory import default_state_dtype

from .cache.hybrid_cache import HybridCache, scratch_cache
from .errors import ConfigError
from .models.hybrid import HybridModel
from .requests import engine_sizes, normalize_requests
from .sampling import RowParams, SamplingParams, process_logits, sample
from .spec.drafters import as_drafter
from .spec.speculator import Speculator
from .stats import EngineStats


@dataclass
class Output:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    finish_reason: Literal["stop", "length"] | None = None


@dataclass
class Request:
    """One sequence being generated: committed tokens = prompt + output."""

    seq_id: int
    params: SamplingParams
    seed: int
    output: Output
    on_emit: Callable[[list[int]], None] | None = None  # called with the tokens each emit keeps

    @property
    def committed_len(self) -> int:
        return len(self.output.prompt_token_ids) + len(self.output.token_ids)

    @property
    def last_token(self) -> int:
        return self.output.token_ids[-1] if self.output.token_ids else self.output.prompt_token_ids[-1]

    def would_keep(self, tokens: list[int]) -> int:
        """How many of `tokens` `emit` would keep: up to and including the first
        stop token, and no more than max_new_tokens in all."""
        room = self.params.max_new_tokens - len(self.output.token_ids)
        for i, t in enumerate(tokens[:room]):
            if int(t) in self.params.stop_token_ids:
                return i + 1
        return min(len(tokens), room)

    def would_finish(self, tokens: list[int]) -> bool:
        """Whether emitting `tokens` ends the request (stop token or length)."""
        kept = self.would_keep(tokens)
        stopped = kept > 0 and int(tokens[kept - 1]) in self.params.stop_token_ids
        return stopped or len(self.output.token_ids) + kept >= self.params.max_new_tokens

    def emit(self, tokens: list[int]) -> int:
        """Append the kept prefix of `tokens` (the rest of a round is cut); set
        finish_reason when a stop token or the length limit is reached."""
        kept = self.would_keep(tokens)
        self.output.token_ids.extend(int(t) for t in tokens[:kept])
        if self.on_emit is not None and kept:
            self.on_emit([int(t) for t in tokens[:kept]])
        if kept and int(tokens[kept - 1]) in self.params.stop_token_ids:
            self.output.finish_reason = "stop"
        elif len(self.output.token_ids) >= self.params.max_new_tokens:
            self.output.finish_reason = "length"
        return kept

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


class Engine:
    """Plain or speculative generation over a `HybridModel`.

    target: the model whose distribution is sampled (`hs.from_hf`, `hs.load`).
    draft: None (plain decoding), a HybridModel sharing the target's
        vocabulary, `hs.NgramDrafter()`, or any `hybridspec.spec.Drafter`.
    num_draft_tokens: γ, drafts per sequence per round.
    checkpoint: a `CheckpointPolicy`, "auto", or None (a snapshot after every input).
    verify: "rejection" (lossless rejection sampling) or "coupled" (output
        token-identical to plain decoding with the same seed).
    max_batch_size, max_model_len, block_size, num_blocks: cache sizes
        (sequences, tokens per sequence, tokens per KV page, KV pages).
    state_dtype: dtype of SSM states and conv windows (None: float32, float64
        for a float64 model).
    """

    def __init__(self, target: HybridModel, draft=None, num_draft_tokens: int = 4, checkpoint=None,
                 verify: Literal["rejection", "coupled"] = "rejection", *, max_batch_size: int = 16,
                 max_model_len: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 state_dtype: torch.dtype | None = None):
        if not isinstance(target, HybridModel):
            raise ConfigError(f"target must be a HybridModel (from hs.from_hf or hs.load), got {type(target).__name__}")
        if verify not in ("rejection", "coupled"):
            raise ConfigError(f"verify={verify!r} must be 'rejection' or 'coupled'")
        if state_dtype is not None and not (isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point):
            raise ConfigError(f"state_dtype={state_dtype!r} must be a floating torch.dtype (e.g. torch.float32) "
                              "or None for the default")
        sizes = engine_sizes(target.config, max_batch_size, max_model_len, block_size, num_blocks)
        self.target = target
        self.verify = verify
        self.max_model_len = sizes.max_model_len
        self.max_batch_size = sizes.max_batch_size
        self.state_dtype = state_dtype or default_state_dtype(target.dtype)
        self.cache_kwargs = dict(max_seqs=sizes.max_batch_size, block_size=sizes.block_size,
                                 num_blocks=sizes.num_blocks, dtype=target.dtype, device=target.device)
        self.stats = EngineStats()
        self.check_invariants = os.environ.get("HYBRIDSPEC_CHECK", "0") not in ("", "0")
        self.speculator: Speculator | None = None
        if draft is None:
            self.cache = self._new_cache(ring_slots=2)
        else:
            validate_gamma(num_draft_tokens)
            policy = resolve_policy(checkpoint).bind(  # "auto" measures step costs here
                target, num_draft_tokens, max_batch_size=self.max_batch_size, state_dtype=self.state_dtype,
                new_cache=functools.partial(scratch_cache, target, state_dtype=self.state_dtype))
            drafter = as_drafter(draft, target, num_draft_tokens, self.cache_kwargs)
            self.cache = self._new_cache(ring_slots=policy.ring_size(num_draft_tokens))
            self.speculator = Speculator(target, drafter, num_draft_tokens, policy, self.cache, self.stats,
                                         coupled=verify == "coupled", check_invariants=self.check_invariants)
        self._next_seq_id = 0

    def _new_cache(self, ring_slots: int) -> HybridCache:
        """The target's cache with this engine's sizes."""
        return HybridCache(self.target.config, ring_slots=ring_slots, state_dtype=self.state_dtype,
                           **self.cache_kwargs)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False, stream: Callable[[int, list[int]], None] | None = None) -> list[Output]:
        """Generate for every prompt; returns one Output per prompt, in order.
        `stream(i, token_ids)`, when given, is called as tokens of prompt i are
        emitted (once per round, after its commit)."""
        prompts, params = normalize_requests(prompts, params, self.target.vocab_size, self.max_batch_size,
                                             self.max_model_len)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            on_emit = None if stream is None else (lambda tokens, i=i: stream(i, tokens))
            requests.append(Request(self._next_seq_id, p, p.resolved_seed(), Output(list(prompt)), on_emit))
            self._next_seq_id += 1
        kv_lens = {r.seq_id: len(r.output.prompt_token_ids) + r.params.max_new_tokens for r in requests}
        self.cache.check_admission(len(requests), kv_lens)
        if self.speculator is not None:
            self.speculator.drafter.check_admission(requests)
        rows = RowParams.of([r.params for r in requests], [r.seed for r in requests], self.target.device)
        bar = tqdm(total=sum(r.params.max_new_tokens for r in requests), disable=not progress, unit="tok")
        try:
            self._prefill(requests, rows)
            bar.update(len(requests))
            loop = self.speculator.run if self.speculator is not None else self._decode_loop
            loop(requests, rows, bar)
        finally:
            self.cache.free_sequences([r.seq_id for r in requests])
            if self.speculator is not None:
                self.speculator.drafter.release([r.seq_id for r in requests])
            bar.close()
        return [r.output for r in requests]

    def _prefill(self, requests: list[Request], rows: RowParams) -> None:
        """Absorb every prompt and emit the first token from the last prompt logits."""
        ids = [r.seq_id for r in requests]
        logits = self.target.prefill(self.cache, ids, [r.output.prompt_token_ids for r in requests],
                                     last_only=True)[:, 0]  # [batch, vocab]
        self.stats.sequences += len(requests)
        self._sample_and_emit(requests, logits, rows)

    def _sample_and_emit(self, requests: list[Request], logits: torch.Tensor, rows: RowParams) -> None:
        with self.stats.phase("sampling"):
            positions = torch.tensor([r.committed_len for r in requests], device=logits.device)
            tokens = sample(process_logits(logits, rows), rows, positions).tolist()
        for r, t in zip(requests, tokens):
            r.emit([t])
        self.stats.emitted_tokens += len(requests)

    def _decode_loop(self, requests: list[Request], rows: RowParams, bar) -> None:
        """Plain decoding: one target step per token for every unfinished sequence."""
        index = {r.seq_id: i for i, r in enumerate(requests)}
        active = [r for r in requests if not r.finished]
        while active:
            self.cache.free_sequences([r.seq_id for r in requests if r.finished])
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
