"""Speculative rounds: propose → verify → accept → commit (DESIGN.md "Round
structure"). At a round start a sequence has committed tokens t[0..m-1],
computed length m-1 and the pending token t[m-1].

1. propose: the drafter gives d_1..d_γ and q_1..q_γ;
2. verify: the target runs [t[m-1], d_1..d_γ] at positions m-1..m-1+γ; its
   logits at input j give p_{j+1}; Mamba layers write the policy's snapshots;
3. accept: rejection sampling (or greedy / coupled) gives n accepted drafts
   and one recovered or bonus token;
4. commit: every layer of the target moves to the boundary m+n (state after
   verify input n), the drafter too, then the tokens are emitted.
If any step raises, every sequence returns to where the round began.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError, InvalidRequestError
from ..kernels.rejection import MODE_COUPLED, MODE_GREEDY, MODE_REJECTION, rejection, rejection_ref
from ..models.hybrid import HybridModel
from ..sampling import RowParams, process_logits
from .drafters import ModelDrafter, NgramDrafter
from hybridspec.checkpoints.policy import CheckpointPolicy, validate_gamma
from hybridspec.checkpoints.restore import decide, log_replay, token_replay
from hybridspec.checkpoints.ring import plan_snapshots


class Speculator:
    def __init__(self, engine, draft, num_draft_tokens: int, checkpoint):
        validate_gamma(num_draft_tokens)
        self.engine, self.target, self.gamma = engine, engine.target, num_draft_tokens
        self.policy = CheckpointPolicy() if checkpoint is None else checkpoint
        if isinstance(self.policy, str):
            if self.policy != "auto":
                raise ConfigError(f"checkpoint={checkpoint!r} must be a CheckpointPolicy or 'auto'")
            self.policy = CheckpointPolicy.auto()
        if not isinstance(self.policy, CheckpointPolicy):
            raise ConfigError(f"checkpoint must be a CheckpointPolicy or 'auto', got {type(checkpoint).__name__}")
        if isinstance(draft, HybridModel):
            if draft.vocab_size != self.target.vocab_size:
                raise ConfigError(f"draft vocabulary ({draft.vocab_size}) differs from the target's "
                                  f"({self.target.vocab_size}); the drafter must share the target's tokenizer")
            self.drafter = ModelDrafter(draft, num_draft_tokens, engine.cache_kwargs)
        elif isinstance(draft, NgramDrafter):
            self.drafter = draft
        else:
            raise ConfigError(f"draft must be a HybridModel (hs.from_hf / hs.load) or hs.NgramDrafter, "
                              f"got {type(draft).__name__}")
        self.coupled = engine.verify == "coupled"
        self.policy = self.policy.bind(engine, num_draft_tokens)  # "auto" measures step costs here
        self.target_ring_slots = self.policy.ring_size(num_draft_tokens)
        self.acceptance_history: list[float] = []
        self.check = engine.check_invariants

    # -- lifecycle ----------------------------------------------------------------------------

    def check_admission(self, requests) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.check_admission(requests)

    def release(self, seq_ids) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.release(seq_ids)

    def run(self, requests, rows: RowParams, bar) -> None:
        active = [r for r in requests if not r.finished]
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.start(requests)
        index = {r.seq_id: i for i, r in enumerate(requests)}
        while active:
            select = torch.tensor([index[r.seq_id] for r in active], device=self.target.device)
            emitted = self.round(active, rows.select(select))
            bar.update(emitted)
            finished = [r.seq_id for r in active if r.finished]
            self.engine.cache.free_sequences(finished)
            self.release(finished)
            active = [r for r in active if not r.finished]

    # -- one round ----------------------------------------------------------------------------

    def propose(self, requests, rows: RowParams) -> tuple[list[list[int]], torch.Tensor]:
        """Drafts per row (γ clamped so a round never passes max_new_tokens) and q [batch, G, vocab]."""
        gammas = [min(self.gamma, r.params.max_new_tokens - len(r.output.token_ids) - 1) for r in requests]
        vocab = self.target.vocab_size
        if isinstance(self.drafter, NgramDrafter):
            drafts = [self.drafter.lookup(r.output.prompt_token_ids + r.output.token_ids, g) if g > 0 else []
                      for r, g in zip(requests, gammas)]
            G = max(1, max(map(len, drafts)))
            q = torch.zeros(len(requests), G, vocab, dtype=torch.float64, device=self.target.device)
            for b, d in enumerate(drafts):
                for i, t in enumerate(d):
                    if 0 <= t < vocab:
                        q[b, i, t] = 1.0
        elif max(gammas) > 0:
            drafts, q = self.drafter.propose(requests, gammas, rows, self.coupled)
        else:
            drafts, q = [[] for _ in requests], torch.zeros(len(requests), 1, vocab, dtype=torch.float64)
        for d in drafts:
            bad = [t for t in d if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise InvalidRequestError(f"the drafter proposed token id {bad[0]!r} outside the target "
                                          f"vocabulary [0, {vocab}); no state was changed")
        return drafts, q

    def round(self, requests, rows: RowParams) -> int:
        """One draft → verify → commit cycle; returns the number of emitted tokens."""
        engine, cache, stats = self.engine, self.engine.cache, self.engine.stats
        ids = [r.seq_id for r in requests]
        start = [r.committed_len - 1 for r in requests]  # computed_len m-1
        heads = [cache.head(s) for s in ids]
        try:
            with stats.phase("draft"):
                drafts, q = self.propose(requests, rows)
            inputs = [[r.last_token] + d for r, d in zip(requests, drafts)]
            T = max(map(len, inputs))
            policy = self.policy.for_round(self.acceptance_history)
            plans, snap = self._plan(ids, heads, inputs, T, policy)
            input_log = {} if policy.log_inputs and cache.states is not None else None
            with stats.phase("verify"):
                logits = self.target.extend(cache, ids, inputs, snap_slot=snap, input_log=input_log)
            with stats.phase("sampling"):
                tokens, accepted = self.accept(logits, q, drafts, rows, start)
            with stats.phase("commit"):
                emitted = [t[:n + 1] for t, n in zip(tokens, accepted)]
                kept = [r.would_keep(e) for r, e in zip(requests, emitted)]
                live = [b for b, (r, e) in enumerate(zip(requests, emitted)) if not r.would_finish(e)]
                self.commit(requests, plans, inputs, start, accepted, live, input_log)
        except BaseException:
            self.revert(ids, start, heads)
            raise
        for r, t, n, k in zip(requests, tokens, accepted, kept):
            r.emit(t[:k])
        self._count(requests, drafts, accepted, kept, plans, input_log, cache)
        return sum(kept)

    def _plan(self, ids, heads, inputs, T, policy):
        cache = self.engine.cache
        plans, snap = [], torch.full((len(ids), T), -1, dtype=torch.long, device=self.target.device)
        for b, (s, head, inp) in enumerate(zip(ids, heads, inputs)):
            if cache.states is None:
                plans.append(None)
                continue
            plan = plan_snapshots(cache.states.ring_slots(s), head, policy.snapshot_inputs(len(inp)), T)
            plans.append(plan)
            snap[b] = torch.tensor(plan.snap_slot, device=snap.device)
        return plans, snap

    def accept(self, logits, q, drafts, rows: RowParams, start):
        """Rejection sampling over post-processed p and q: (emitted tokens per row, accepted counts)."""
        B, T, V = logits.shape
        p = process_logits(logits.reshape(B * T, V), rows.repeat(T)).view(B, T, V)  # [batch, G + 1, vocab]
        G = max(T - 1, 1)  # a round without drafts still passes one (unused) draft column
        if T == 1:
            p = torch.cat([p, p], dim=1)
        draft_probs = torch.zeros(B, G, V, dtype=p.dtype, device=p.device)  # [batch, G, vocab]
        draft_probs[:, :min(G, q.shape[1])] = q[:, :G].to(p.dtype)
        draft_tokens = torch.zeros(B, G, dtype=torch.long, device=p.device)  # [batch, G]
        for b, d in enumerate(drafts):
            draft_tokens[b, :len(d)] = torch.tensor(d, dtype=torch.long)
        num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=p.device)
        mode = torch.where(rows.is_greedy, MODE_GREEDY, MODE_COUPLED if self.coupled else MODE_REJECTION)
        positions = torch.tensor(start, dtype=torch.long, device=p.device) + 1  # position m of d_1
        verify = rejection if p.is_cuda else rejection_ref
        out, n = verify(p, draft_probs, draft_tokens, num_draft, mode.to(torch.long), rows.seeds, positions)
        return out.tolist(), n.tolist()

    def commit(self, requests, plans, inputs, start, accepted, live, input_log) -> None:
        """Move the target and the drafter of every row in `live` (those the
        round does not finish) to its boundary."""
        cache = self.engine.cache
        decisions = [decide(plans[b], accepted[b], input_log is not None) if b in live and plans[b] else None
                     for b in range(len(requests))]
        self.decisions = decisions
        ids = [r.seq_id for r in requests]
        if cache.states is not None:
            log_replay(self.target, cache, decisions, input_log)
            token_replay(self.target, cache, ids, decisions, inputs, start)
        for b in live:
            boundary = start[b] + accepted[b] + 1
            cache.commit(ids[b], boundary, decisions[b].dst_slot if decisions[b] else -1)
            if isinstance(self.drafter, ModelDrafter):
                self.drafter.commit(ids[b], boundary + 1)
            if self.check:
                cache.check_invariant(ids[b], boundary + 1)
                if isinstance(self.drafter, ModelDrafter):
                    self.drafter.check_invariant(ids[b], boundary + 1)

    def revert(self, ids, start, heads) -> None:
        cache = self.engine.cache
        for s, length, head in zip(ids, start, heads):
            if cache.has_sequence(s):
                cache.commit(s, length, head)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.revert(ids)

    def _count(self, requests, drafts, accepted, kept, plans, input_log, cache) -> None:
        stats = self.engine.stats
        stats.rounds += 1
        stats.sequence_rounds += len(requests)
        stats.drafted_tokens += sum(map(len, drafts))
        stats.accepted_tokens += sum(min(n, k) for n, k in zip(accepted, kept))
        stats.emitted_tokens += sum(kept)
        for d in self.decisions:
            if d is None:
                continue
            if d.path == "hit":
                stats.snapshot_hits += 1
            elif d.path == "log":
                stats.log_replayed_tokens += d.num_steps
            else:
                stats.token_replayed_tokens += d.num_steps
        slot_bytes = cache.states.bytes_per_slot if cache.states is not None else 0
        held = sum(len(p.survivors) * slot_bytes for p in plans if p is not None)
        held += sum(log.nbytes() for log in input_log.values()) if input_log else 0
        stats.peak_checkpoint_bytes = max(stats.peak_checkpoint_bytes, held)
        drafted = sum(map(len, drafts))
        if drafted:
            self.acceptance_history.append(sum(accepted) / drafted)
