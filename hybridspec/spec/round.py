"""`RoundBatch`: everything one speculative round knows about its batch, in
one typed place (docs/design.md, "Round structure"). Row b is `requests[b]`.

Lengths. A row starts the round with committed tokens t[0..m-1] and computed
length `start_lens[b] = m - 1` (t[m-1] is pending). Its verify inputs are
[t[m-1], d_1 .. d_g] at positions m-1 .. m-1+g. With n drafts accepted the
row's boundary is m + n, `boundary(b)`: the computed length every layer of
the target and the drafter is moved to. Every commit call in the round takes
this one length, a computed length.

What a round gives each row is a `RowResult` (`RoundBatch.results`): the
tokens the stop rules keep and whether the row finished. The Engine applies
results, a round's and a plain step's alike, in one place (`Engine._apply`);
only then do the requests' outputs grow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridspec.checkpoints.input_log import InputLog
from hybridspec.checkpoints.restore import RestoreDecision
from hybridspec.checkpoints.ring import SnapshotPlan
from hybridspec.cache.tree_batch import TreeBatch

from hybridspec.sampling.logprobs import TokenLogprob
from hybridspec.sampling.stopping import Cut
from hybridspec.spec.tree import input_parents, spine_boundary


@dataclass(frozen=True)
class RowResult:
    """What one row gains from a round or a plain step."""

    tokens: list[int]  # [kept] the emitted tokens the stop rules keep
    cut: Cut  # the stop rules' verdict: cut.kept = len(tokens), whether and why the row finished
    logprobs: list[TokenLogprob] | None  # [kept] of `tokens`, when the request asks for them

    @classmethod
    def of(cls, request, emitted: list[int], logprobs: list[TokenLogprob] | None) -> "RowResult":
        """`emitted` (and their `logprobs`) cut by `request`'s stop rules; the
        tokens as Python ints from here on."""
        emitted = [int(t) for t in emitted]
        cut = request.cut(emitted)
        return cls(emitted[:cut.kept], cut, None if logprobs is None else logprobs[:cut.kept])

    @property
    def finished(self) -> bool:
        return self.cut.finished


@dataclass
class RoundBatch:
    requests: list  # [batch] engine Requests, unfinished at the round start
    seq_ids: list[int]  # [batch]
    start_lens: list[int]  # [batch] computed_len m-1 at the round start
    start_heads: list[int]  # [batch] ring head at the round start (-1: no recurrent layers); never written
    gammas: list[int] = field(default_factory=list)  # [batch] drafts asked of the drafter (clamped to the request)
    drafts: list[list[int]] = field(default_factory=list)  # [batch][g_b] d_1..d_g, g_b <= γ
    draft_probs: torch.Tensor | None = None  # [batch, G, vocab] q, post-processed; None: one-hot drafts
    plans: list[SnapshotPlan | None] = field(default_factory=list)  # [batch] where the snapshots go
    snap_slot: list[list[int]] | None = None  # [batch][G + 1] ring slot written after verify input t, -1: none
    input_log: InputLog | None = None  # the verify forward's mixer inputs, when the policy logs
    accepted: list[int] = field(default_factory=list)  # [batch] n: drafts the verifier kept
    tokens: list[list[int]] = field(default_factory=list)  # [batch][n + 1] accepted drafts + recovered/bonus
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)  # [batch] of `tokens`, if asked for
    results: list[RowResult] = field(default_factory=list)  # [batch] `tokens` cut by the stop rules
    live: list[int] = field(default_factory=list)  # rows the round does not finish: they commit
    # [batch] how each live row restored (a tree round's: its indices along the row's accepted path)
    decisions: list[RestoreDecision | None] = field(default_factory=list)
    backlog_seconds: float = 0.0  # the drafter's one-off absorption of backlogs in this round (`Proposal`)
    backlog_tokens: int = 0
    parents: list[list[int]] | None = None  # [batch][g_b] tree drafts' parents (`spec.tree`); None: chains
    tree: TreeBatch | None = None  # a tree round's forward: its indices (its snapshots go to the ring)
    paths: list[list[int]] = field(default_factory=list)  # [batch][n + 1] a tree round's accepted verify inputs

    @property
    def verify_inputs(self) -> list[list[int]]:
        """[t[m-1], d_1, …, d_g] per row."""
        return [[r.last_token] + d for r, d in zip(self.requests, self.drafts)]

    @property
    def num_inputs(self) -> int:
        """T = G + 1: the padded length of the verify forward."""
        return 1 + max(map(len, self.drafts))

    @property
    def kept(self) -> list[int]:
        """[batch] of `tokens`, how many the stop rules keep."""
        return [r.cut.kept for r in self.results]

    def boundary(self, b: int) -> int:
        """Computed length of row b after the commit: m + n."""
        return self.start_lens[b] + self.accepted[b] + 1

    def drafter_boundary(self, b: int) -> int:
        """Where row b's drafter commits to: the boundary, or in a tree round the end of
        the accepted path's prefix on the drafter's own spine (`spec.tree.spine_boundary`)."""
        if self.parents is None:
            return self.boundary(b)
        return spine_boundary(self.paths[b], input_parents(self.parents[b]), self.start_lens[b])
