"""Drafters propose d_1..d_γ, with their post-processed probabilities
q_1..q_γ when they have them. Every drafter answers the `Drafter` protocol,
which is all the Engine and the round ask of one: neither ever asks which
kind it holds.

- `NgramDrafter` (prompt lookup): continue the most recent earlier match of
  the longest suffix n-gram of the committed tokens; no probabilities (q is
  one-hot: `Proposal.probs` is None and the rejection kernel takes it so).
- `ModelDrafter`: any HybridModel (hybrid, pure Mamba or pure attention) with
  its own cache. Each round that drafts it feeds the committed tokens it has
  not absorbed (one, or two after a fully accepted round; a prompt, or the
  tokens of rounds that drafted nothing, in a forward of their own first) and
  then its own drafts, never d_γ; at commit its head moves to the boundary
  (clamped to what it absorbed). Greedy rows without penalties or filters
  draft d_2 … d_γ in one C call (`HybridModel.greedy_chain`), the bits of
  the step-by-step loop.

Lengths: `commit(seq_ids, boundaries)` and `check_invariant(seq_id,
boundary)` take the target's boundary of each row, a computed length (m + n
in docs/design.md's round indices).

`as_draft` normalises what `Engine(draft=...)` and `LLM(draft=...)` accept,
`as_drafter` makes the Engine's drafter of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from hybridspec.kernels.keyed_random import PURPOSE_DRAFT, PURPOSE_SAMPLE

from ..adapters import load
from ..cache.hybrid_cache import HybridCache
from ..cache.prefix_cache import PrefixCache, PrefixStore
from ..errors import ConfigError, InvariantError
from ..models.hybrid import HybridModel
from ..penalties import penalty_context
from ..sampling import RowParams, process_logits, sample


@dataclass
class Proposal:
    tokens: list[list[int]]  # [batch][g_b] d_1..d_g of each row, g_b = gammas[b] or fewer
    probs: torch.Tensor | None  # [batch, G, vocab] q_1..q_G after post-processing; None: one-hot drafts
    backlog_seconds: float = 0.0  # of this propose, absorbing backlogs (prompts, skipped rounds): one-off work
    backlog_tokens: int = 0  # the tokens those absorbed


@runtime_checkable
class Drafter(Protocol):
    """Everything the Engine and the speculative round ask of a drafter.
    `requests` are the engine's requests (committed tokens =
    `prompt_token_ids + token_ids`).

    model: the HybridModel it runs, or None. The Engine measures its step for
        adaptive γ and captures its forwards with CUDA graphs; the rollback
        suite prefills it to check the drafter's state.
    cache: its HybridCache of `model` (one row per sequence), or None. The
        scheduler admits and preempts by its free pages too.
    prefix: its own prefix cache over `cache` (`PrefixStore`), or None. It
        gives up cached pages when the scheduler needs room in `cache`.
    A drafter without them (`StatelessDrafter`) has all three None."""

    model: HybridModel | None
    cache: HybridCache | None
    prefix: PrefixStore | None

    def start(self, requests) -> None:
        """Take on new requests (absorb their prompts)."""

    def backlog(self, requests) -> list[int]:
        """Per request, the committed tokens the next round that drafts for it
        absorbs before its catch-up (adaptive γ charges them); 0 for none."""

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: bool) -> Proposal:
        """Up to gammas[b] drafts per row (gammas may all be 0: the round then
        drafts nothing); `coupled`: sample with the target's own keyed noise
        (verify="coupled") instead of the drafter's."""

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        """Move each sequence to its accepted boundary (a computed length)."""

    def revert(self, seq_ids: list[int]) -> None:
        """Undo the last `propose` and any commit since, for these sequences."""

    def release(self, seq_ids: list[int]) -> None:
        """Forget finished sequences."""

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        """Raise InvariantError if the sequence's state is not at or before
        `boundary` (a computed length)."""


class StatelessDrafter:
    """Base for drafters that keep nothing per sequence: no model, cache or
    prefix store, nothing to absorb; only `propose` is theirs."""

    model = cache = prefix = None

    def start(self, requests) -> None:
        pass

    def backlog(self, requests) -> list[int]:
        return [0] * len(requests)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: bool) -> Proposal:
        raise NotImplementedError

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        pass

    def revert(self, seq_ids: list[int]) -> None:
        pass

    def release(self, seq_ids: list[int]) -> None:
        pass

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        pass


class NgramDrafter(StatelessDrafter):
    """Prompt-lookup drafting over the committed tokens of each sequence
    (prompt and output): find the most recent earlier occurrence of the
    longest suffix n-gram and propose the tokens that followed it. No model,
    no probabilities (q is one-hot); a round with no match drafts nothing.

    max_ngram: the longest suffix n-gram looked up, in tokens (default 3).
    min_ngram: the shortest (default 1); 1 <= min_ngram <= max_ngram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram={min_ngram} <= max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        """Continuation of the most recent earlier occurrence of the longest suffix n-gram."""
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    proposal = context[start + n:start + n + gamma]
                    if proposal:
                        return proposal
        return []

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: bool) -> Proposal:
        tokens = [self.lookup(r.output.prompt_token_ids + r.output.token_ids, g) if g > 0 else []
                  for r, g in zip(requests, gammas)]
        return Proposal(tokens, None)


def _backlog_len(gap: int) -> int:
    """Tokens absorbed before a round's catch-up by a drafter `gap` committed
    tokens behind: all but the last where more than two (`_absorb_backlog`)."""
    return gap - 1 if gap > 2 else 0


class ModelDrafter:
    """A HybridModel used as drafter, with its own cache and ring, and with
    `prefix_cache` settings its own prefix cache (`PrefixStore`; what it did
    adds up in `prefix.counts`)."""

    def __init__(self, model: HybridModel, gamma: int, cache_kwargs: dict, prefix_cache: PrefixCache | None = None):
        self.model = model
        kwargs = dict(cache_kwargs, dtype=model.dtype, device=model.device)
        # up to γ + 1 forwards per round (backlog, catch-up, γ - 1 drafts) each write a new slot;
        # the round-start head stays intact
        self.cache = HybridCache(model.config, ring_slots=gamma + 2, **kwargs)
        self.slot_at: dict[int, dict[int, int]] = {}  # seq -> computed_len -> slot holding that state
        self.round_start: dict[int, tuple[int, int]] = {}  # seq -> (computed_len, head) before the last propose
        self.prefix = None if prefix_cache is None else PrefixStore(model, self.cache, prefix_cache)
        self.requests: dict[int, object] = {}  # seq -> its request, for the committed tokens at release

    def start(self, requests) -> None:
        """Take the sequences on; their prompts are absorbed by the first round
        that drafts for them (a sequence that never drafts costs nothing). With
        the prefix cache they are absorbed now, from their prefix hits (a resumed
        sequence: all its committed tokens but the pending one), so that the pages
        they share are known before the scheduler reserves the next round."""
        if self.prefix is None:
            self.cache.add_sequences([r.seq_id for r in requests])
            return
        committed = [r.output.prompt_token_ids + r.output.token_ids for r in requests]
        self.prefix.prefill([r.seq_id for r in requests],
                            [c[:-1] if r.output.token_ids else c for c, r in zip(committed, requests)],
                            [r.params.cache_checkpoints for r in requests], [False] * len(requests))
        self.requests.update((r.seq_id, r) for r in requests)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: bool) -> Proposal:
        """Drafts for the rows with gammas[b] > 0 only (the others cost nothing
        and get none); q is [batch, G, vocab], zero on rows without drafts.
        The proposal carries what absorbing backlogs took (`_absorb_backlog`)."""
        ids = [r.seq_id for r in requests]
        G = max(gammas)
        every_row_greedy = rows.flags.all_greedy  # of the whole batch, before the drafting rows are picked
        self.round_start = {s: (self.cache.computed_len[s], self.cache.head(s)) for s in ids}
        self.slot_at = {s: {} for s in ids}
        if G == 0:  # the round only samples the target's next token
            return Proposal([[] for _ in ids], None)
        active = [b for b, g in enumerate(gammas) if g > 0]
        drafting = [requests[b] for b in active]
        if len(active) < len(requests):
            rows = rows.select(torch.tensor(active, device=self.model.device))
        ids_active = [r.seq_id for r in drafting]
        committed = [r.output.prompt_token_ids + r.output.token_ids for r in drafting]
        backlog = self._absorb_backlog(ids_active, committed)  # (seconds, tokens) for the Proposal
        catch_up = [c[self.cache.computed_len[s]:] for s, c in zip(ids_active, committed)]
        greedy = (rows.flags.all_greedy and not rows.flags.any_filter and G > 1
                  and not any(r.params.has_penalties for r in drafting) and self.model.greedy_chain is not None)
        if greedy:  # the catch-up and the drafts in one call, where it runs
            out = self.model.greedy_chain.extend(self.cache, ids_active, catch_up, G - 1)
            if out is not None:
                first, later, logits, heads = out
                self._record_steps(ids_active, heads)
                return self._greedy_proposal(ids, active, gammas, first, later, logits, every_row_greedy, backlog)
        logits = self.model.extend(self.cache, ids_active, catch_up, last_only=True)[:, 0]  # [active, vocab]
        self._record(ids_active)
        purpose = PURPOSE_SAMPLE if coupled else PURPOSE_DRAFT
        context = penalty_context(drafting, logits.shape[-1], logits.device)  # q_{i+1} sees d_1..d_i, as p_{i+1}
        if greedy:
            fast = self._greedy(ids, active, ids_active, gammas, logits, G, every_row_greedy, backlog)
            if fast is not None:
                return fast
        drafts, probs = [], []
        for i in range(G):
            q = process_logits(logits, rows, context)  # [active, vocab]
            positions = torch.tensor([len(c) + i for c in committed], device=q.device)
            d = sample(q, rows, positions, purpose)
            context = None if context is None else context.append(d)
            drafts.append(d)
            probs.append(q)
            if i < G - 1:
                logits = self.model.decode(self.cache, ids_active, d.tolist())
                self._record(ids_active)
        tokens = [[] for _ in ids]
        for b, t in zip(active, torch.stack(drafts, 1).tolist()):  # [active, G]
            tokens[b] = t[:gammas[b]]
        q = torch.stack(probs, 1)  # [active, G, vocab]
        return Proposal(tokens, _scatter_rows(q, active, len(requests)), *backlog)

    def _greedy(self, ids, active, ids_active, gammas, logits, G: int, one_hot: bool,
                backlog: tuple[float, int]) -> Proposal | None:
        """The drafts of greedy rows without penalties or filters after a catch-up
        of its own: d_1 the argmax of the catch-up's logits, d_2 … d_G from
        the model's `greedy_chain.decode` (G - 1 steps in one call, the bits of
        step-by-step decoding). None where the chain declines
        (nothing changed)."""
        first = logits.argmax(dim=-1).tolist()  # [active]
        out = self.model.greedy_chain.decode(self.cache, ids_active, first, G - 1)
        if out is None:
            return None
        later, step_logits, heads = out
        self._record_steps(ids_active, heads)
        return self._greedy_proposal(ids, active, gammas, first, later,
                                     torch.cat([logits[:, None], step_logits], 1), one_hot, backlog)

    def _record_steps(self, ids_active, heads: list[list[int]]) -> None:
        """What `_record` keeps after each forward of a call (`heads[b]`: row b's ring
        head after each, one position apart, the last at the current length)."""
        for s, row_heads in zip(ids_active, heads):
            start = self.cache.computed_len[s] - len(row_heads)
            for k, head in enumerate(row_heads):
                self.slot_at[s][start + k + 1] = head

    def _greedy_proposal(self, ids, active, gammas, first: list[int], later: list[list[int]],
                         logits: torch.Tensor, one_hot: bool, backlog: tuple[float, int]) -> Proposal:
        """Greedy rows' drafts d_1 = first[b], d_2 … = later[b] and their logits
        [active, G, vocab]. q: None (one-hot drafts, what a greedy drafter's
        are) when `one_hot` (every row of the batch greedy: the greedy accept
        reads no q), else what `process_logits` gives such rows, the float64
        softmax."""
        tokens = [[] for _ in ids]
        for b, d1, rest in zip(active, first, later):
            tokens[b] = ([d1] + rest)[:gammas[b]]
        if one_hot:
            return Proposal(tokens, None, *backlog)
        q = torch.softmax(logits.to(torch.float64), dim=-1)  # [active, G, vocab]
        return Proposal(tokens, _scatter_rows(q, active, len(ids)), *backlog)

    def backlog(self, requests) -> list[int]:
        """Per request, the tokens the next round that drafts for it absorbs
        first (`_absorb_backlog`): all but the last committed one where it is
        more than two behind (a new prompt, rounds that drafted nothing), else 0."""
        return [_backlog_len(r.committed_len - self.cache.computed_len[r.seq_id]) for r in requests]

    def _absorb_backlog(self, ids: list[int], committed: list[list[int]]) -> tuple[float, int]:
        """Rows more than two committed tokens behind (a new prompt, or rounds
        that drafted nothing) absorb all but their last committed token in a
        forward of their own, so the round's catch-up pads no row to a prompt's
        length. Where the catch-ups would then differ in length (rows two
        behind beside rows one behind: a round that accepted every draft beside
        one that did not), the rows two behind absorb their first token in one
        more forward of one input per row, so that every catch-up is one token
        and the catch-up and the drafts run as one call
        (`GreedyChain.extend`) instead of a padded forward. Like the
        catch-up each writes a fresh ring slot: a revert still returns to the
        round start. Returns (seconds, tokens) of the backlogs' forward:
        one-off work, which adaptive γ learns per token and amortises."""
        gaps = [len(c) - self.cache.computed_len[s] for s, c in zip(ids, committed)]
        behind = [(s, c[self.cache.computed_len[s]:-1]) for s, c, gap in zip(ids, committed, gaps) if _backlog_len(gap)]
        two = [(s, c[-2:-1]) for s, c, gap in zip(ids, committed, gaps) if gap == 2]
        began = time.perf_counter()
        if behind:
            self.model.extend(self.cache, [s for s, _ in behind], [t for _, t in behind], last_only=True)
        seconds = time.perf_counter() - began  # one-off work; the rows two behind are a round's
        if two and len(two) < len(ids):
            self.model.extend(self.cache, [s for s, _ in two], [t for _, t in two], last_only=True)
        return seconds, sum(len(t) for _, t in behind)

    def _record(self, ids) -> None:
        for s in ids:
            self.slot_at[s][self.cache.computed_len[s]] = self.cache.head(s)

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        """Move to each accepted boundary, clamped to what was absorbed."""
        for s, boundary in zip(seq_ids, boundaries):
            length = min(boundary, self.cache.computed_len[s])
            start_len, start_head = self.round_start[s]
            slot = start_head if length == start_len else self.slot_at[s][length]  # a round that drafted nothing
            self.cache.commit(s, length, slot)

    def revert(self, seq_ids: list[int]) -> None:
        """Back to where the last propose began (its head slot was never written)."""
        for s in seq_ids:
            if s in self.round_start and self.cache.has_sequence(s):
                length, head = self.round_start[s]
                self.cache.rewind_to(s, length, head)

    def release(self, seq_ids: list[int]) -> None:
        if self.prefix is not None:
            # a finished row's last propose was never committed: back to its round start, a boundary
            self.revert([s for s in seq_ids if self.cache.has_sequence(s)])
            requests = [self.requests.pop(s, None) for s in seq_ids]
            self.prefix.release(seq_ids, [None if r is None else r.output.prompt_token_ids + r.output.token_ids
                                          for r in requests])
        self.cache.free_sequences(seq_ids)
        for s in seq_ids:
            self.round_start.pop(s, None)
            self.slot_at.pop(s, None)

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        computed = self.cache.computed_len[seq_id]
        self.cache.check_invariant(seq_id, computed)
        if computed > boundary:
            raise InvariantError(f"drafter of sequence {seq_id} absorbed {computed} tokens, past the boundary "
                                 f"{boundary}")


def _scatter_rows(q: torch.Tensor, rows: list[int], batch: int) -> torch.Tensor:
    """q of the drafting rows [len(rows), G, vocab] in a [batch, G, vocab] tensor,
    zero on the rows that drafted nothing (q itself when every row drafted)."""
    if len(rows) == batch:
        return q
    full = q.new_zeros(batch, *q.shape[1:])  # [batch, G, vocab]
    full[torch.tensor(rows, device=q.device)] = q
    return full


DRAFT_FORMS = ('None (plain decoding), "ngram" (prompt lookup), a draft checkpoint directory, a HybridModel '
               '(hs.from_hf / hs.load) sharing the target\'s vocabulary, hs.NgramDrafter(...), or a Drafter: '
               'model, cache, prefix, start, backlog, propose, commit, revert, release and check_invariant '
               '(hybridspec.spec.Drafter; a subclass of hs.StatelessDrafter writes propose only)')


def as_draft(draft, dtype: torch.dtype | None = None, device=None) -> HybridModel | Drafter | None:
    """What an `Engine(draft=...)` or `LLM(draft=...)` argument names, in one of
    the forms an Engine runs: None, a HybridModel, or a Drafter. "ngram" is
    `NgramDrafter()`; any other string or path is a draft checkpoint directory,
    loaded (`hs.load`) in `dtype` on `device` (None: the checkpoint's dtype, the CPU)."""
    if draft is None or isinstance(draft, (HybridModel, Drafter)):
        return draft
    if isinstance(draft, str) and draft == "ngram":
        return NgramDrafter()
    if isinstance(draft, (str, Path)):
        return load(draft, dtype=dtype, device="cpu" if device is None else device)
    raise ConfigError(f"draft={_short(draft)} ({type(draft).__name__}) is not a drafter; pass {DRAFT_FORMS}")


def as_drafter(draft, target: HybridModel, gamma: int, cache_kwargs: dict,
               prefix_cache: PrefixCache | None = None) -> Drafter | None:
    """The Engine's drafter for its `draft` argument (`as_draft`; a checkpoint
    directory loads in the target's dtype, on its device): None for plain
    decoding, a HybridModel run as a `ModelDrafter` (with its own prefix cache
    when `prefix_cache` is set), or the Drafter itself."""
    draft = as_draft(draft, target.dtype, target.device)
    if not isinstance(draft, HybridModel):
        return draft
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocabulary ({draft.vocab_size}) differs from the target's "
                          f"({target.vocab_size}); the drafter must share the target's tokenizer")
    return ModelDrafter(draft, gamma, cache_kwargs, prefix_cache)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
