"""Drafters propose d_1..d_γ with their post-processed probabilities q_1..q_γ.

- `NgramDrafter` (prompt lookup): continue the most recent earlier match of
  the longest suffix n-gram of the committed tokens; q is one-hot.
- `ModelDrafter`: any HybridModel (hybrid, pure Mamba or pure attention) with
  its own cache. Each round it feeds the committed tokens it has not absorbed
  (one, or two after a fully accepted round) and then its own drafts, never
  d_γ; at commit its head moves to the boundary (clamped to what it absorbed).
"""
from __future__ import annotations

import torch

from ..cache.hybrid_cache import HybridCache
from ..kernels.keyed_random import PURPOSE_DRAFT, PURPOSE_SAMPLE
from ..sampling import RowParams, process_logits, sample


class NgramDrafter:
    """Prompt-lookup drafting over the committed tokens of each sequence."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            from ..errors import ConfigError
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


class ModelDrafter:
    """A HybridModel used as drafter, with its own cache and ring."""

    def __init__(self, model, gamma: int, cache_kwargs: dict):
        self.model = model
        kwargs = dict(cache_kwargs, dtype=model.dtype, device=model.device)
        # γ steps per round (catch-up + γ-1 drafts) each write a new slot; the head stays intact
        self.cache = HybridCache(model.config, ring_slots=gamma + 1, **kwargs)
        self.slot_at: dict[int, dict[int, int]] = {}  # seq -> computed_len -> slot holding that state
        self.round_start: dict[int, tuple[int, int]] = {}

    def check_admission(self, requests) -> None:
        kv_lens = {r.seq_id: len(r.output.prompt_token_ids) + r.params.max_new_tokens for r in requests}
        self.cache.check_admission(len(requests), kv_lens)

    def start(self, requests) -> None:
        """Absorb the prompts."""
        ids = [r.seq_id for r in requests]
        self.model.prefill(self.cache, ids, [r.output.prompt_token_ids for r in requests], last_only=True)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: bool):
        """Drafts [batch] lists (len gammas[b]) and q [batch, G, vocab]."""
        ids = [r.seq_id for r in requests]
        G = max(gammas)
        committed = [r.output.prompt_token_ids + r.output.token_ids for r in requests]
        self.round_start = {s: (self.cache.computed_len[s], self.cache.head(s)) for s in ids}
        self.slot_at = {s: {} for s in ids}
        catch_up = [c[self.cache.computed_len[s]:] for s, c in zip(ids, committed)]
        logits = self.model.extend(self.cache, ids, catch_up, last_only=True)[:, 0]  # [batch, vocab]
        self._record(ids)
        purpose = PURPOSE_SAMPLE if coupled else PURPOSE_DRAFT
        drafts, probs = [], []
        for i in range(G):
            q = process_logits(logits, rows)  # [batch, vocab]
            positions = torch.tensor([len(c) + i for c in committed], device=q.device)
            d = sample(q, rows, positions, purpose)
            drafts.append(d)
            probs.append(q)
            if i < G - 1:
                logits = self.model.decode(self.cache, ids, d.tolist())
                self._record(ids)
        tokens = torch.stack(drafts, 1).tolist()  # [batch, G]
        return [t[:g] for t, g in zip(tokens, gammas)], torch.stack(probs, 1)

    def _record(self, ids) -> None:
        for s in ids:
            self.slot_at[s][self.cache.computed_len[s]] = self.cache.head(s)

    def commit(self, seq_id: int, committed_len: int) -> None:
        """Move to the boundary committed_len - 1, clamped to what was absorbed."""
        absorbed = self.cache.computed_len[seq_id]
        boundary = min(committed_len - 1, absorbed)
        self.cache.commit(seq_id, boundary, self.slot_at[seq_id][boundary])

    def revert(self, seq_ids) -> None:
        """Back to the round start (its head slot was never written this round)."""
        for s in seq_ids:
            if s in self.round_start and self.cache.has_sequence(s):
                length, head = self.round_start[s]
                self.cache.commit(s, length, head)

    def check_invariant(self, seq_id: int, committed_len: int) -> None:
        computed = self.cache.computed_len[seq_id]
        self.cache.check_invariant(seq_id, computed + 1)
        if computed > committed_len - 1:
            from ..errors import InvariantError
            raise InvariantError(f"drafter of sequence {seq_id} absorbed {computed} tokens, past the boundary "
                                 f"{committed_len - 1}")

    def release(self, seq_ids) -> None:
        self.cache.free_sequences(seq_ids)
