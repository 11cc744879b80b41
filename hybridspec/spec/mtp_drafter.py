"""`MTPDrafter`: drafting with the target checkpoint's own multi-token-prediction
layer (`models/mtp.py`), through the `Drafter` protocol.

Round indices (docs/design.md): at a round start the target has absorbed
positions 0..m-2 and its hidden states there are committed (`HiddenStates`,
point L: the last layer's output); t[m-1] is pending. The MTP layer pairs h_p
with t[p+1], so it can absorb every position up to m-2, and its output at
m-2 predicts t[m] = d_1. Each round that drafts for a row:

1. catch-up: the positions the target committed since the row last drafted
   (the accepted verify inputs of the last round, the bonus' predecessor
   included; a whole prompt the first time), with the target's hidden states:
   never a rejected token's, which `HiddenStates` never hands out;
2. drafts: d_k from the layer run on its own output o and d_{k-1}, γ_b - 1
   more times. These positions hold the MTP's guesses, not the target's
   hidden states, so `commit` rolls the layer's K/V back to the end of the
   catch-up: the next round absorbs the accepted ones with the target's.

With a `TreeShape` (`tree=`) it proposes trees as a draft model does
(`spec.tree.branch`): a chain of the shape's spine length and, at each depth,
the next most likely tokens of its distribution there as leaves. A tree
verify's hidden states are pending until the round lays out the accepted
path's (`HiddenStates.follow_path`), so the catch-up reads the accepted
tokens' rows in order, as after a chain round.

Its attention K/V lives in a cache of its own, rolled back by length. The
layer's positions start where the target's hidden states start: a sequence
whose prompt came partly from the prefix cache (no forward, so no hidden
state) is absorbed from the first computed position, the cached ones unseen
by the MTP layer (its drafts may be worse there; the output is the target's
whatever it drafts, and rotary attention sees only relative positions).
"""
from __future__ import annotations

import torch

from hybridspec.cache.hidden_states import HiddenStates
from hybridspec.errors import InvariantError
from hybridspec.kernels.keyed_random import PURPOSE_DRAFT, PURPOSE_SAMPLE
from hybridspec.models.mtp import MTPLayer
from hybridspec.sampling.penalties import penalty_context
from hybridspec.sampling.sampler import RowParams, process_logits, sample
from hybridspec.spec.model_drafter import backlog_len, scatter_rows
from hybridspec.spec.protocol import Proposal
from hybridspec.spec.tree import TreeShape, branch_rows


class MTPDrafter:
    """An `MTPLayer` as drafter; `cache_kwargs` size its K/V cache as the target's."""

    model = prefix = None  # no HybridModel of its own: its cost is measured through `propose`

    def __init__(self, layer: MTPLayer, cache_kwargs: dict, tree: TreeShape | None = None):
        self.layer, self.tree = layer, tree
        self.cache = layer.new_cache(**{k: v for k, v in cache_kwargs.items() if k not in ("dtype", "device")})
        num_layers = layer.target[0].config.num_layers
        self.hidden = HiddenStates((num_layers,), num_layers)  # what the target's cache records for it
        self.offset: dict[int, int] = {}  # seq -> target position of the layer's position 0
        self.pending: dict[int, torch.Tensor] = {}  # seq -> hidden rows [n, hidden] taken, not yet absorbed
        self.absorbed: dict[int, tuple[int, torch.Tensor]] = {}  # seq -> (layer length before, rows) of this round
        self.true_len: dict[int, int] = {}  # seq -> the layer's length after this round's catch-up

    def scratch(self, cache_kwargs: dict) -> "MTPDrafter":
        """A drafter of the same layer over a cache of its own (`cache_kwargs`): what start-up times
        rounds with (`engine.startup_costs`), leaving this one's sequences alone."""
        return type(self)(self.layer, cache_kwargs, self.tree)

    def start(self, requests) -> None:
        self.cache.add_sequences([r.seq_id for r in requests])

    def backlog(self, requests) -> list[int]:
        """Positions past a normal catch-up (a prompt, rounds that drafted nothing) the next round absorbs."""
        return [backlog_len(r.committed_len - 1 - self._position(r.seq_id)) for r in requests]

    def _position(self, seq_id: int) -> int:
        """The target position the layer absorbs next."""
        return self.offset.get(seq_id, 0) + self.cache.computed_len[seq_id] + len(self.pending.get(seq_id, ()))

    def _take(self, seq_id: int) -> None:
        """Move the target's newly committed hidden states into `pending`."""
        first, rows = self.hidden.take(seq_id)
        if rows is None:
            return
        rows = self.features(rows)  # [n, hidden]
        if seq_id not in self.offset:
            self.offset[seq_id] = first
        elif first != self._position(seq_id):  # a gap (the row restarted from a prefix hit): start again there
            self.cache.free_sequences([seq_id])
            self.cache.add_sequences([seq_id])
            self.offset[seq_id], self.pending[seq_id] = first, rows[:0]
        held = self.pending.get(seq_id)
        self.pending[seq_id] = rows if held is None or not len(held) else torch.cat([held, rows])

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """What the layer reads beside each token, from the target's rows [n, k, hidden]:
        h_p itself (point L, the only one), [n, hidden]."""
        return rows[:, 0]

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        """Chains (`draft_chains`), or with `tree` trees of up to gammas[b] nodes: the chain of
        each row's spine length, branched (`spec.tree.branch_rows`), as `ModelDrafter.propose`."""
        if self.tree is None or max(gammas, default=0) == 0:
            return self.draft_chains(requests, gammas, rows, coupled)
        chains = self.draft_chains(requests, [self.tree.spine_length(g) for g in gammas], rows, coupled,
                                   keep_q=True)
        if chains.probs is None:  # no row had hidden states to draft from
            return chains
        tokens, probs, parents = branch_rows(chains.tokens, chains.probs, gammas, self.tree)
        return Proposal(tokens, probs, parents=parents)

    def draft_chains(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool],
                     keep_q: bool = False) -> Proposal:
        """Catch-up of each drafting row, then its drafts; rows without hidden states to read draft
        nothing. q is None where every row is greedy (one-hot drafts) unless `keep_q`."""
        ids = [r.seq_id for r in requests]
        every_row_greedy = rows.flags.all_greedy  # of the whole batch, before the drafting rows are picked
        for s, g in zip(ids, gammas):  # a row that drafts nothing leaves its rows where they are, uncopied
            if g > 0:
                self._take(s)
        self.absorbed = {}
        self.true_len = {s: self.cache.computed_len[s] for s in ids}
        active = [b for b, g in enumerate(gammas) if g > 0 and len(self.pending.get(ids[b], ())) > 0]
        tokens: list[list[int]] = [[] for _ in ids]
        if not active:
            return Proposal(tokens, None)
        if len(active) < len(requests):
            rows = rows.select(torch.tensor(active, device=self.layer.device))
        drafting = [requests[b] for b in active]
        logits, out = self._catch_up(drafting)
        greedy = (rows.flags.all_greedy and not rows.flags.any_filter
                  and not any(r.params.has_penalties for r in drafting))
        one_hot = greedy and every_row_greedy  # the greedy accept reads no q: drafts are one-hot
        probs = self._draft(drafting, [gammas[b] for b in active], rows, [coupled[b] for b in active], logits, out,
                            tokens, active, greedy, keep_q=keep_q or not one_hot)
        return Proposal(tokens, None if probs is None else scatter_rows(probs, active, len(ids)))

    def _catch_up(self, drafting) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over each row's pending positions: (logits [rows, vocab], o [rows, hidden]) at the last."""
        ids = [r.seq_id for r in drafting]
        token_lists, hidden_lists = [], []
        for r in drafting:
            s, committed = r.seq_id, r.output.prompt_token_ids + r.output.token_ids
            first = self._position(s) - len(self.pending[s])
            token_lists.append(committed[first + 1:first + 1 + len(self.pending[s])])  # t[p+1] beside h_p
            hidden_lists.append(self.pending[s])
        logits, out = self.layer.extend(self.cache, ids, token_lists, hidden_lists)
        for s, rows in zip(ids, hidden_lists):
            self.absorbed[s] = (self.cache.computed_len[s] - len(rows), rows)
            self.true_len[s] = self.cache.computed_len[s]
            del self.pending[s]
        return logits, out

    def _draft(self, drafting, limits: list[int], rows: RowParams, coupled: list[bool], logits: torch.Tensor,
               out: torch.Tensor, tokens: list[list[int]], active: list[int], greedy: bool,
               keep_q: bool = True) -> torch.Tensor | None:
        """d_1..d_{limits[j]} of each drafting row into `tokens` (`greedy`: each the argmax, as a greedy
        row's processed distribution gives it); returns q [rows, G, vocab] (for greedy rows the float64
        softmax of the logits, what `process_logits` gives them), None without `keep_q`."""
        G, device = max(limits), logits.device
        purpose = torch.tensor([PURPOSE_SAMPLE if c else PURPOSE_DRAFT for c in coupled], device=device)
        context = penalty_context(drafting, logits.shape[-1], device)  # q_{i+1} sees d_1..d_i, as p_{i+1}
        committed = [r.committed_len for r in drafting]
        probs = None  # [rows, G, vocab]
        live = list(range(len(drafting)))
        for i in range(G):
            if greedy:
                d = logits.argmax(dim=-1)
                q = torch.softmax(logits.to(torch.float64), dim=-1) if keep_q else None
            else:
                q = process_logits(logits, rows, context)  # [live, vocab]
                d = sample(q, rows, torch.tensor([committed[j] + i for j in live], device=device), purpose)
            if q is not None:
                if probs is None:
                    probs = q.new_zeros(len(drafting), G, q.shape[-1])
                probs[live, i] = q
            for j, token in zip(live, d.tolist()):
                tokens[active[j]].append(token)
            keep = [k for k, j in enumerate(live) if limits[j] > i + 1]
            if not keep:
                break
            context = None if context is None else context.append(d)
            if len(keep) < len(live):
                picked = torch.tensor(keep, device=device)
                d, out, rows, purpose = d[picked], out[picked], rows.select(picked), purpose[picked]
                context = None if context is None else context.select(picked)
                live = [live[k] for k in keep]
            logits, out = self.layer.extend(self.cache, [drafting[j].seq_id for j in live],
                                            [[t] for t in d.tolist()], list(out.unsqueeze(1)))
        return probs

    def commit(self, seq_ids: list[int], boundaries: list[int]) -> None:
        """Drop the drafts' positions: the layer keeps what it absorbed with the target's hidden states."""
        for s in seq_ids:
            length = self.true_len.get(s, self.cache.computed_len[s])
            if self.cache.computed_len[s] > length:
                self.cache.rewind_to(s, length, -1)
            self.absorbed.pop(s, None)

    def revert(self, seq_ids: list[int]) -> None:
        """Back to the round start: the catch-up's rows are pending again."""
        for s in seq_ids:
            if not self.cache.has_sequence(s):
                continue
            length, rows = self.absorbed.pop(s, (self.true_len.get(s, self.cache.computed_len[s]), None))
            if self.cache.computed_len[s] > length:
                self.cache.rewind_to(s, length, -1)
            self.true_len[s] = length
            if rows is not None:
                held = self.pending.get(s)
                self.pending[s] = rows if held is None else torch.cat([rows, held])

    def release(self, seq_ids: list[int]) -> None:
        self.cache.free_sequences(seq_ids)
        self.hidden.drop(seq_ids)
        for s in seq_ids:
            for held in (self.offset, self.pending, self.absorbed, self.true_len):
                held.pop(s, None)

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        computed = self.cache.computed_len[seq_id]
        self.cache.check_invariant(seq_id, computed)
        position = self.offset.get(seq_id, 0) + computed
        if position > boundary:
            raise InvariantError(f"{type(self).__name__} of sequence {seq_id} absorbed up to position {position}, "
                                 f"past the boundary {boundary}")
