"""Speculative rounds: propose → verify → accept → commit (docs/design.md,
"Round structure"). At a round start a sequence has committed tokens
t[0..m-1], computed length m-1 and the pending token t[m-1].

1. propose: the drafter gives d_1..d_γ and q_1..q_γ (or none: one-hot);
2. verify: the target runs [t[m-1], d_1..d_γ] at positions m-1..m-1+γ; its
   logits at input j give p_{j+1}; Mamba layers write the snapshots the
   `Checkpointer` planned;
3. accept: rejection sampling (or greedy / coupled) gives n accepted drafts
   and one recovered or bonus token;
4. commit: the stop rules cut each row's tokens (`RowResult`); the
   `Checkpointer` moves every layer of the target to the boundary m+n (state
   after verify input n) of each row the round does not finish, and the
   drafter follows.
If any step raises, every sequence returns to where the round began.
Everything the round knows travels in one `RoundBatch`, which `round` returns:
the Engine applies its `results` to the requests (emits the tokens).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch

from hybridspec.checkpoints.checkpointer import Checkpointer
from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.kernels.reference import MODE_COUPLED, MODE_GREEDY, MODE_REJECTION, greedy_accept

from hybridspec.errors import InvalidRequestError, PeerRankError
from hybridspec.sampling.grammar import verify_masks
from hybridspec.sampling.logprobs import batch_logprobs, token_logprobs
from hybridspec.models.hybrid import HybridModel
from hybridspec.sampling.next_token import sample_next
from hybridspec.sampling.penalties import penalty_context
from hybridspec.sampling.sampler import RowParams, argmax_suffices, process_logits
from hybridspec.spec.drafters import Drafter, Proposal
from hybridspec.spec.round import RoundBatch, RowResult
from hybridspec.spec.tree import check_parents, input_parents
from hybridspec.cache.tree_batch import TreeBatch
from hybridspec.spec.tree_accept import as_chains, multi_draft, tree_paths

if TYPE_CHECKING:  # the engine passes its counters in; spec sits below the engine
    from hybridspec.engine.stats import EngineStats


class RoundHook(Protocol):
    """Watches rounds from outside (the rollback suite's `RoundObserver`)."""

    def round_started(self, round: RoundBatch) -> None: ...

    def phase_started(self, phase: str) -> None: ...  # "draft" | "verify" | "commit"

    def committed(self, round: RoundBatch) -> None: ...  # after every live row reached its boundary

    def round_ended(self, round: RoundBatch, error: BaseException | None) -> None: ...  # after the commit or revert


class Speculator:
    """Runs speculative rounds of `target` against `drafter` with γ = `gamma`
    drafts per sequence, snapshots placed by `policy`, the target's caches in
    `cache`. `coupled`: verify="coupled"; `check_invariants`: assert the
    boundary invariant after every commit.

    Which rule verifies a row (`coupled_rows`): greedy rows the greedy rule;
    sampled rows coupled under verify="coupled"; under verify="rejection"
    (the default) a sampled row whose request carries a seed is verified
    coupled too (its tokens are then plain seeded sampling's, whatever the
    batch, γ or drafter: a seed reproduces under any load), and a row without
    one by rejection sampling (it accepts the most drafts). Both rules are
    lossless: coupled output is plain sampling from the target's distribution."""

    def __init__(self, target: HybridModel, drafter: Drafter, gamma: int, policy: CheckpointPolicy, cache,
                 coupled: bool = False, check_invariants: bool = False):
        self.target, self.drafter, self.gamma, self.policy = target, drafter, gamma, policy
        self.cache, self.coupled, self.check = cache, coupled, check_invariants
        self.checkpointer = Checkpointer(target, cache)
        hidden = getattr(drafter, "hidden", None)  # a drafter reading the target's hidden states (MTP, EAGLE-3)
        if hidden is not None:
            cache.hidden = hidden  # every forward of the target over `cache` records them
        self.acceptance_history: list[float] = []  # accepted / drafted of every round so far
        self.hooks: list[RoundHook] = []

    # -- one round ----------------------------------------------------------------------------

    def round(self, requests, rows: RowParams, stats: EngineStats, gammas: list[int] | None = None) -> RoundBatch:
        """One draft → verify → accept → commit cycle over `requests` (every
        one unfinished, each in the target's cache and started in the
        drafter); `gammas`: drafts to ask for per row (default γ each; 0 makes
        the row a plain step inside the round). Times its phases and counts
        its tokens in `stats`. Returns the round's RoundBatch (drafts,
        accepted counts, `results`: what each request gains, not yet applied)."""
        ids = [r.seq_id for r in requests]
        round = RoundBatch(requests, ids, [r.committed_len - 1 for r in requests], [self.cache.head(s) for s in ids])
        self._notify("round_started", round)
        error = None
        try:
            self._phase("draft")
            self.propose(round, rows, stats, gammas)
            self._phase("verify")
            self.verify(round, rows, stats)
            self._phase("commit")
            self.commit(round, stats)
        except BaseException as raised:
            error = raised
        tp = self.target.tensor_parallel
        if tp is not None:  # the round fails on every rank (hybridspec.tp.group)
            if error is not None:
                tp.abort()
            if not tp.agree(error is None) and error is None:
                error = PeerRankError("another tensor-parallel rank's round raised; this rank reverted its round too")
        if error is not None:
            self.revert(round)
            self._notify("round_ended", round, error)
            raise error
        self._count(round, stats)
        self._notify("round_ended", round, None)
        return round

    def propose(self, round: RoundBatch, rows: RowParams, stats: EngineStats, gammas: list[int] | None = None) -> None:
        """Drafts per row (γ clamped so a round never passes max_new_tokens) and q."""
        with stats.phase("draft"):
            asked = [self.gamma] * len(round.requests) if gammas is None else gammas
            gammas = [max(0, min(g, r.params.max_new_tokens - len(r.output.token_ids) - 1))
                      for g, r in zip(asked, round.requests)]
            round.gammas = gammas
            proposal: Proposal = self.drafter.propose(round.requests, gammas, rows, self.coupled_rows(round.requests))
            vocab = self.target.vocab_size
            for d, g in zip(proposal.tokens, gammas):
                bad = [t for t in d if not (isinstance(t, int) and 0 <= t < vocab)]
                if bad:
                    raise InvalidRequestError(f"the drafter proposed token id {bad[0]!r} outside the target "
                                              f"vocabulary [0, {vocab}); no state was changed")
                if len(d) > g:
                    raise InvalidRequestError(f"the drafter proposed {len(d)} tokens where at most {g} were asked "
                                              "for; no state was changed")
            self._check_probs(proposal, len(round.requests))
            if proposal.parents is not None:
                check_parents(proposal.tokens, proposal.parents)
            round.drafts, round.draft_probs, round.parents = proposal.tokens, proposal.probs, proposal.parents
            round.backlog_seconds, round.backlog_tokens = proposal.backlog_seconds, proposal.backlog_tokens

    def _check_probs(self, proposal: Proposal, batch: int) -> None:
        """q must be [batch, ≥ longest draft, vocab] when a drafter gives it."""
        q, longest, vocab = proposal.probs, max(map(len, proposal.tokens), default=0), self.target.vocab_size
        if q is None:
            return
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != batch or q.shape[2] != vocab \
                or q.shape[1] < longest:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise InvalidRequestError(f"the drafter's probabilities have shape {shape}; a Proposal's probs must be "
                                      f"[batch={batch}, >= {longest} drafts, vocab={vocab}] or None for one-hot "
                                      "drafts; no state was changed")

    def verify(self, round: RoundBatch, rows: RowParams, stats: EngineStats) -> None:
        """The target's forward over the verify inputs, then the accept rule."""
        if round.parents is not None:
            return self.verify_tree(round, rows, stats)
        self.checkpointer.plan(round, self.policy.for_round(self.acceptance_history, len(round.seq_ids)))
        with stats.phase("verify"):
            logits = self.target.extend(self.cache, round.seq_ids, round.verify_inputs, snap_slot=round.snap_slot,
                                        input_log=round.input_log)  # [batch, G + 1, vocab]
        with stats.phase("sampling"):
            round.tokens, round.accepted = self.accept(logits, round, rows)

    def verify_tree(self, round: RoundBatch, rows: RowParams, stats: EngineStats) -> None:
        """A tree round's verify (`spec.tree`): one target forward over every row's tree,
        each row's candidate path, then that path verified as a chain (`accept`)."""
        round.tree = TreeBatch([input_parents(p) for p in round.parents], self.target.device, keep_states=False)
        self.checkpointer.plan_tree(round, self.policy.for_round(self.acceptance_history, len(round.seq_ids)))
        with stats.phase("verify"):
            logits = self.target.extend(self.cache, round.seq_ids, round.verify_inputs, snap_slot=round.snap_slot,
                                        input_log=round.input_log, tree=round.tree)  # [batch, T, vocab]
        with stats.phase("sampling"):
            round.paths = tree_paths(logits, round, rows, self.coupled_rows(round.requests))
            chain_logits, chains = as_chains(logits, round, round.paths)
            round.tokens, round.accepted = self.accept(chain_logits, chains, rows)
            round.logprobs = chains.logprobs
            round.paths = [path[:n + 1] for path, n in zip(round.paths, round.accepted)]
            for b, (path, tokens, p) in multi_draft(logits, round, rows, self.coupled_rows(round.requests)).items():
                round.paths[b], round.tokens[b], round.accepted[b] = path, tokens, len(path) - 1
                k = round.requests[b].params.logprobs
                round.logprobs[b] = None if k is None else token_logprobs(p, tokens, k)

    def accept(self, logits: torch.Tensor, round: RoundBatch, rows: RowParams) -> tuple[list[list[int]], list[int]]:
        """Rejection sampling over post-processed p and q: (emitted tokens per row, accepted counts);
        the emitted tokens' log-probabilities go to `round.logprobs`."""
        B, T, V = logits.shape
        if T == 1:  # no row drafted: a plain step's sampling (the same keyed noise at the same position)
            tokens, round.logprobs = sample_next(logits[:, 0], rows, round.requests)
            return [[t] for t in tokens], [0] * B
        allowed = verify_masks(round.requests, round.drafts, T)  # [batch, G + 1, vocab]: input j after d_1..d_j
        if allowed is not None:  # −inf outside the grammar, before every other processing (as plain sampling)
            logits = logits.masked_fill(~allowed.to(logits.device), -math.inf)
        if argmax_suffices(rows, round.requests):  # greedy_accept on p's argmax, the logits'
            round.logprobs = [None] * B
            return greedy_accept(logits, round.drafts)
        context = penalty_context(round.requests, V, logits.device)  # p_{j+1} sees d_1..d_j, as q_{j+1} did
        context = None if context is None else context.with_drafts(round.drafts, T)
        # each row's parameters once per input; not needed when no filter or penalty reads them
        flat_rows = rows.repeat(T) if context is not None or rows.flags.any_filter else rows
        p = process_logits(logits.reshape(B * T, V), flat_rows, context).view(B, T, V)  # [batch, G + 1, vocab]
        if rows.flags.all_greedy:  # one argmax and one readback (the greedy rule needs no q and no noise)
            tokens, accepted = greedy_accept(p, round.drafts)
        else:
            tokens, accepted = self._rejection(p, round, rows)
        round.logprobs = batch_logprobs(p, [t[:a + 1] for t, a in zip(tokens, accepted)], round.requests)
        return tokens, accepted

    def _rejection(self, p: torch.Tensor, round: RoundBatch, rows: RowParams) -> tuple[list[list[int]], list[int]]:
        """The rejection kernel (or its reference) over p [batch, G + 1, vocab]: emitted tokens, accepted counts."""
        B, T, V = p.shape
        G = T - 1
        q = None
        if round.draft_probs is not None:
            q = torch.zeros(B, G, V, dtype=p.dtype, device=p.device)  # [batch, G, vocab]
            q[:, :min(G, round.draft_probs.shape[1])] = round.draft_probs[:, :G].to(p.dtype)
        def tensor(values):  # one host-to-device copy per index tensor
            return torch.tensor(values, dtype=torch.long, device=p.device)
        draft_tokens = tensor([list(d) + [0] * (G - len(d)) for d in round.drafts]).view(B, G)  # [batch, G]
        num_draft = tensor([len(d) for d in round.drafts])  # [batch]
        mode = tensor([MODE_GREEDY if r.params.is_greedy else MODE_COUPLED if coupled else MODE_REJECTION
                       for r, coupled in zip(round.requests, self.coupled_rows(round.requests))])  # [batch]
        positions = tensor([m + 1 for m in round.start_lens])  # [batch]: position m of d_1
        verify = self.target.backend.rejection  # the target's backend's (Triton or torch)
        out, n = verify(p, q, draft_tokens, num_draft, mode, rows.seeds, positions)
        return out.tolist(), n.tolist()

    def coupled_rows(self, requests) -> list[bool]:
        """Per row, whether a sampled row is verified coupled (and drafted with
        the target's own keyed noise): every row under verify="coupled", else
        the rows whose request was given a seed (`SamplingParams.seed`; the
        samples of a seeded request with n > 1 too), so that a seeded request
        gives the same tokens alone or beside any others, at any γ."""
        return [self.coupled or r.params.seed is not None for r in requests]

    def commit(self, round: RoundBatch, stats: EngineStats) -> None:
        """Cut each row's tokens at its stops (`round.results`), then move the
        target (every layer) and the drafter of every row the round does not
        finish to its boundary."""
        with stats.phase("commit"):
            round.results = [RowResult.of(r, t[:n + 1], lp)
                             for r, t, n, lp in zip(round.requests, round.tokens, round.accepted, round.logprobs)]
            round.live = [b for b, result in enumerate(round.results) if not result.finished]
            if round.parents is None:
                self.checkpointer.commit(round)
            else:
                if self.cache.hidden is not None:  # the accepted path's hidden states, at their positions
                    for b in round.live:
                        self.cache.hidden.follow_path(round.seq_ids[b], round.paths[b])
                self.checkpointer.commit_tree(round)
            live_ids = [round.seq_ids[b] for b in round.live]
            boundaries = [round.boundary(b) for b in round.live]
            self.drafter.commit(live_ids, [round.drafter_boundary(b) for b in round.live])
            if self.check:
                for s, boundary in zip(live_ids, boundaries):
                    self.cache.check_invariant(s, boundary)
                    self.drafter.check_invariant(s, boundary)
            self._notify("committed", round)

    def revert(self, round: RoundBatch) -> None:
        """Every sequence of the round, target and drafter, back to the round start."""
        self.checkpointer.revert(round)
        self.drafter.revert(round.seq_ids)

    # -- bookkeeping --------------------------------------------------------------------------

    def _count(self, round: RoundBatch, stats: EngineStats) -> None:
        drafted = sum(map(len, round.drafts))
        stats.rounds += 1
        stats.sequence_rounds += len(round.requests)
        stats.drafted_tokens += drafted
        stats.accepted_tokens += sum(min(n, k) for n, k in zip(round.accepted, round.kept))
        stats.emitted_tokens += sum(round.kept)
        for d in round.decisions:
            if d is None:
                continue
            if d.path == "hit":
                stats.snapshot_hits += 1
            elif d.path == "log":
                stats.log_replayed_tokens += d.num_steps
            else:
                stats.token_replayed_tokens += d.num_steps
        for g in round.gammas:
            stats.gamma_counts[g] = stats.gamma_counts.get(g, 0) + 1
        stats.peak_checkpoint_bytes = max(stats.peak_checkpoint_bytes, self.checkpointer.held_bytes(round))
        if drafted:
            self.acceptance_history.append(sum(round.accepted) / drafted)

    def _phase(self, phase: str) -> None:
        self._notify("phase_started", phase)

    def _notify(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event)(*args)
