"""`ModelDrafter`: any HybridModel (hybrid, pure Mamba or pure attention) as
drafter, with its own cache. Each round that drafts it feeds the committed
tokens it has not absorbed (one, or two after a fully accepted round; a
prompt, or the tokens of rounds that drafted nothing, in a forward of their
own first) and then its own drafts, never d_γ, each row only up to its own
γ_b; at commit its head moves to the boundary (clamped to what it absorbed).
Greedy rows without penalties or filters draft d_2 … d_γ in one C call
(`HybridModel.greedy_chain`), the bits of the step-by-step loop.

With a `TreeShape` (`tree=`, off by default) it proposes trees (`spec.tree`):
a shorter chain, its spine, and at each depth the next most likely tokens of
its distribution there as leaves beside it, within the row's γ nodes.
"""
from __future__ import annotations

import time

import torch

from hybridspec.kernels.keyed_random import PURPOSE_DRAFT, PURPOSE_SAMPLE

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.prefix_cache import PrefixCache, PrefixStore
from hybridspec.errors import InvariantError
from hybridspec.models.hybrid import HybridModel
from hybridspec.sampling.grammar import DraftWalk, has_grammar
from hybridspec.sampling.penalties import penalty_context
from hybridspec.sampling.sampler import RowParams, process_logits, sample
from hybridspec.spec.protocol import Proposal
from hybridspec.spec.tree import TreeShape, branch_rows


def backlog_len(gap: int) -> int:
    """Tokens absorbed before a round's catch-up by a drafter `gap` committed
    tokens behind: all but the last where more than two (`_absorb_backlog`)."""
    return gap - 1 if gap > 2 else 0


class ModelDrafter:
    """A HybridModel used as drafter, with its own cache and ring, and with
    `prefix_cache` settings its own prefix cache (`PrefixStore`; what it did
    adds up in `prefix.counts`)."""

    def __init__(self, model: HybridModel, gamma: int, cache_kwargs: dict, prefix_cache: PrefixCache | None = None,
                 tree: TreeShape | None = None):
        self.model, self.tree = model, tree
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
                            [r.params.save_states_at for r in requests], [False] * len(requests))
        self.requests.update((r.seq_id, r) for r in requests)

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        """Chains of drafts (`draft_chains`), or with `tree` trees of up to gammas[b]
        nodes: the chain of each row's spine length, branched (`spec.tree.branch_rows`)."""
        if self.tree is None or max(gammas, default=0) == 0:
            return self.draft_chains(requests, gammas, rows, coupled)
        chains = self.draft_chains(requests, [self.tree.spine_length(g) for g in gammas], rows, coupled,
                                   keep_probs=True)
        tokens, probs, parents = branch_rows(chains.tokens, chains.probs, gammas, self.tree)
        return Proposal(tokens, probs, chains.backlog_seconds, chains.backlog_tokens, parents)

    def draft_chains(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool],
                     keep_probs: bool = False) -> Proposal:
        """Drafts for the rows with gammas[b] > 0 only (the others cost nothing
        and get none), row b drafting gammas[b] (with the target's keyed noise
        where coupled[b], its own elsewhere) and stepping no further (its
        cache holds no position the scheduler did not reserve,
        `scheduler.round_positions`); q is [batch, G, vocab], zero where a row
        drafted nothing (with `keep_probs` also where every row is greedy). The
        proposal carries what absorbing backlogs took (`_absorb_backlog`)."""
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
        limits = [gammas[b] for b in active]
        committed = [r.output.prompt_token_ids + r.output.token_ids for r in drafting]
        backlog = self._absorb_backlog(ids_active, committed)  # (seconds, tokens) for the Proposal
        catch_up = [c[self.cache.computed_len[s]:] for s, c in zip(ids_active, committed)]
        greedy = (rows.flags.all_greedy and not rows.flags.any_filter and G > 1
                  and not any(r.params.has_penalties for r in drafting) and not has_grammar(drafting)
                  and self.model.greedy_chain is not None)
        if greedy:  # argmax drafts, in few native calls where the chain runs
            drafts, logits = self._greedy_drafts(ids_active, catch_up, limits,
                                                 keep_logits=keep_probs or not every_row_greedy)
            return self._greedy_proposal(ids, active, drafts, logits, backlog)
        logits = self.model.extend(self.cache, ids_active, catch_up, last_only=True)[:, 0]  # [active, vocab]
        self._record(ids_active)
        purpose = torch.tensor([PURPOSE_SAMPLE if coupled[b] else PURPOSE_DRAFT for b in active],
                               device=logits.device)  # [active]
        walk = DraftWalk(drafting)  # q_{i+1} masked by the grammar after d_1..d_i, as p_{i+1}
        try:
            drafts, probs = self._sampled_drafts(ids_active, committed, limits, logits, rows, purpose, drafting, walk)
        finally:
            walk.close(drafting)
        tokens = [[] for _ in ids]
        for b, row in zip(active, drafts):
            tokens[b] = row
        return Proposal(tokens, scatter_rows(probs, active, len(requests)), *backlog)

    def _sampled_drafts(self, ids_active, committed, limits, logits, rows, purpose, drafting,
                        walk: DraftWalk) -> tuple[list[list[int]], torch.Tensor]:
        """Drafts sampled step by step from q (post-processed like p: the
        grammar's mask, penalties, filters) and q itself [active, G, vocab]."""
        G = max(limits)
        context = penalty_context(drafting, logits.shape[-1], logits.device)  # q_{i+1} sees d_1..d_i, as p_{i+1}
        drafts = [[] for _ in ids_active]
        probs = None  # [active, G, vocab]
        live = list(range(len(ids_active)))  # the rows still drafting, as indices into `active`
        for i in range(G):
            q = process_logits(walk.mask(logits), rows, context)  # [live, vocab]
            positions = torch.tensor([len(committed[j]) + i for j in live], device=q.device)
            d = sample(q, rows, positions, purpose)
            if probs is None:
                probs = q.new_zeros(len(ids_active), G, q.shape[-1])
            probs[live, i] = q
            for j, token in zip(live, d.tolist()):
                drafts[j].append(token)
            if i == G - 1:
                break
            context = None if context is None else context.append(d)
            walk.advance(d.tolist())
            keep = [k for k, j in enumerate(live) if limits[j] > i + 1]
            if len(keep) < len(live):  # rows at their γ_b step no further
                picked = torch.tensor(keep, device=q.device)
                live, d, rows, purpose = [live[k] for k in keep], d[picked], rows.select(picked), purpose[picked]
                context = None if context is None else context.select(picked)
                walk.select(keep)
            live_ids = [ids_active[j] for j in live]
            logits = self.model.decode(self.cache, live_ids, d.tolist())
            self._record(live_ids)
        return drafts, probs

    def _greedy_drafts(self, ids_active: list[int], catch_up: list[list[int]], limits: list[int],
                       keep_logits: bool) -> tuple[list[list[int]], torch.Tensor | None]:
        """Greedy rows' drafts d_1 … d_{limits[j]} (each the argmax of the last
        forward's logits) and, with `keep_logits`, those logits [active, G,
        vocab] (None without): the catch-up and the steps every row takes in
        one `greedy_chain.extend`, then the steps of the rows with more drafts
        to go in `greedy_chain.decode` calls, one per distinct γ_b; step by step
        where the chain declines, with the same bits."""
        chain, n, G = self.model.greedy_chain, len(ids_active), max(limits)
        out = (chain.extend(self.cache, ids_active, catch_up, min(limits) - 1, argmax_only=not keep_logits)
               if min(limits) > 1 else None)
        if out is not None:
            first, later, logits, heads = out  # logits [active, min(limits), vocab]
            self._record_steps(ids_active, heads)
            drafts = [[f] + rest for f, rest in zip(first, later)]
        else:
            logits = self.model.extend(self.cache, ids_active, catch_up, last_only=True)  # [active, 1, vocab]
            self._record(ids_active)
            drafts = [[t] for t in logits[:, 0].argmax(dim=-1).tolist()]
        further = []  # (rows, first step, their logits [rows, steps, vocab]) of rows drafting past min(limits)
        while live := [j for j in range(n) if len(drafts[j]) < limits[j]]:
            done, steps = len(drafts[live[0]]), min(limits[j] for j in live) - len(drafts[live[0]])
            later, step_logits = self._greedy_steps([ids_active[j] for j in live], [drafts[j][-1] for j in live],
                                                    steps, argmax_only=not keep_logits)
            for j, rest in zip(live, later):
                drafts[j].extend(rest)
            further.append((live, done, step_logits))
        if not keep_logits or not further:  # (every row drafted alike: logits is [active, G, vocab] already)
            return drafts, logits if keep_logits else None
        all_logits = logits.new_zeros(n, G, logits.shape[-1])
        all_logits[:, :logits.shape[1]] = logits
        for live, done, step_logits in further:
            all_logits[live, done:done + step_logits.shape[1]] = step_logits
        return drafts, all_logits

    def _greedy_steps(self, ids: list[int], tokens: list[int], steps: int,
                      argmax_only: bool = False) -> tuple[list[list[int]], torch.Tensor]:
        """`steps` greedy decode steps of these rows from `tokens`: the tokens
        [rows][steps] and logits [rows, steps, vocab], in one chain call where
        it runs (`argmax_only`: `GreedyChain.decode`'s)."""
        out = self.model.greedy_chain.decode(self.cache, ids, tokens, steps, argmax_only)
        if out is not None:
            later, logits, heads = out
            self._record_steps(ids, heads)
            return later, logits
        later, step_logits = [[] for _ in ids], []
        for _ in range(steps):
            logits = self.model.decode(self.cache, ids, tokens)  # [rows, vocab]
            self._record(ids)
            tokens = logits.argmax(dim=-1).tolist()
            for row, token in zip(later, tokens):
                row.append(token)
            step_logits.append(logits)
        return later, torch.stack(step_logits, 1)

    def _record_steps(self, ids_active, heads: list[list[int]]) -> None:
        """What `_record` keeps after each forward of a call (`heads[b]`: row b's ring
        head after each, one position apart, the last at the current length)."""
        for s, row_heads in zip(ids_active, heads):
            start = self.cache.computed_len[s] - len(row_heads)
            for k, head in enumerate(row_heads):
                self.slot_at[s][start + k + 1] = head

    def _greedy_proposal(self, ids, active, drafts: list[list[int]], logits: torch.Tensor | None,
                         backlog: tuple[float, int]) -> Proposal:
        """Greedy rows' drafts and their logits [active, G, vocab]. q: None
        (one-hot drafts, what a greedy drafter's are) without logits (every row
        of the batch greedy: the greedy accept reads no q), else what
        `process_logits` gives such rows, the float64 softmax."""
        tokens = [[] for _ in ids]
        for b, row in zip(active, drafts):
            tokens[b] = row
        if logits is None:
            return Proposal(tokens, None, *backlog)
        q = torch.softmax(logits.to(torch.float64), dim=-1)  # [active, G, vocab]
        return Proposal(tokens, scatter_rows(q, active, len(ids)), *backlog)

    def backlog(self, requests) -> list[int]:
        """Per request, the tokens the next round that drafts for it absorbs
        first (`_absorb_backlog`): all but the last committed one where it is
        more than two behind (a new prompt, rounds that drafted nothing), else 0."""
        return [backlog_len(r.committed_len - self.cache.computed_len[r.seq_id]) for r in requests]

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
        behind = [(s, c[self.cache.computed_len[s]:-1]) for s, c, gap in zip(ids, committed, gaps) if backlog_len(gap)]
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


def scatter_rows(q: torch.Tensor, rows: list[int], batch: int) -> torch.Tensor:
    """q of the drafting rows [len(rows), G, vocab] in a [batch, G, vocab] tensor,
    zero on the rows that drafted nothing (q itself when every row drafted)."""
    if len(rows) == batch:
        return q
    full = q.new_zeros(batch, *q.shape[1:])  # [batch, G, vocab]
    full[torch.tensor(rows, device=q.device)] = q
    return full
