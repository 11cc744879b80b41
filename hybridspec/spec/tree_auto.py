"""Chain or tree per round (`Engine(tree="auto")`): the draft shape `spec.shape_choice`
picks at the batch's learned costs, with the rescue rate β and a tree round's price
learned online from tree rounds.

Each round, after `GammaController.choose` gave the rows' γ (its chain at G,
the most any row drafts), `TreeAuto.choose` prices that chain and each tree of
`TREE_CANDIDATES` at every budget of 2 … γ_max nodes (`shape_choice.candidates`):

- tokens per round: the closed forms at α, the mean acceptance estimate of the
  drafting rows (the controller's), and β (`costs.tree_form`);
- seconds: the chain's `GammaController.round_cost` plus its expected replay;
  a tree's `GammaController.shape_cost` (its spine's drafter steps, the verify
  forward, sampling and commit of its nodes: a tree of n nodes is priced as
  the chain round of n drafts, which is what the native tree forward costs)
  times the batch's learned tree scale.

`shape_choice.choose` keeps the chain unless a tree's goodput beats it by
more than its margin; a chosen tree sets each drafting row's γ to its budget
(the speculator still clamps it to the row's room) and the drafter's
`tree` for the round (None: chains). Whatever the shape, greedy and coupled
rows emit plain decoding's tokens (`spec.tree`), so the choice moves speed only.

Learning, from each round that verified a tree (`TreeOutcome`, from the
round's parents and accepted paths):
- β: alternatives accepted over spine misses at depths that had alternatives
  (exponentially weighted counts with `RESCUE_TRIALS` pseudo-misses at the
  prior `costs.tree_form.DEFAULT_RESCUE`), per engine, so per drafter;
- the tree scale, per batch bucket: the round's measured seconds over its
  chain-priced `shape_cost` (an average in log space, as the controller's
  scales). Its prior is 1 where the target's whole native forward takes tree
  forwards, `DECLINED_SCALE` where it declines them (a backend without the
  whole forward: the tree runs layer by layer, several times a chain's
  verify), so a tree is tried
  there only where it wins by that much, and then measured.
α is learned along the spines (`GammaController.observe(tree=...)`); tree
rounds teach none of the chain's cost scales.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hybridspec.costs.tree_form import DEFAULT_RESCUE
from hybridspec.spec.gamma import GammaController, _Acceptance, _Learned
from hybridspec.spec.shape_choice import TREE_CANDIDATES, TREE_MARGIN, Candidate, candidates, choose
from hybridspec.spec.tree import TreeShape, drafts_on_spine, input_parents, spine_inputs

DECLINED_SCALE = 3.0  # a tree round's price over its chain pricing where the native forward declines trees
RESCUE_TRIALS = 4.0  # pseudo-misses of β's prior
MIN_SECONDS = 1e-9  # a round's price at least (goodput divides by it)


@dataclass(frozen=True)
class TreeOutcome:
    """What one tree round's accepted paths say, per row and in all."""

    spine_drafted: list[int]  # per row: its spine's drafts (the chain the drafter followed)
    spine_accepted: list[int]  # per row: of those, accepted before the path left the spine or ended
    rescued: int  # spine misses at a depth with alternatives where an alternative was accepted
    misses: int  # spine misses at a depth with alternatives
    spine: int  # the longest spine of a row
    nodes: int  # the most nodes of a row


def tree_outcome(parents: list[list[int]], paths: list[list[int]]) -> TreeOutcome:
    """The outcome of a round of rows with these `Proposal.parents` and accepted
    verify-input paths (`RoundBatch.paths`: the root, then one input per accepted draft)."""
    drafted, accepted, rescued, misses = [], [], 0, 0
    for row_parents, path in zip(parents, paths):
        in_parents = input_parents(row_parents)
        spine = spine_inputs(in_parents)
        on = drafts_on_spine(path, spine)
        drafted.append(len(spine) - 1)
        accepted.append(on)
        if on + 1 < len(spine) and sum(p == spine[on] for p in in_parents) > 1:  # a miss where alternatives stood
            misses += 1
            rescued += on + 1 < len(path)  # the path went on through an alternative
    return TreeOutcome(drafted, accepted, rescued, misses, max(drafted, default=0),
                       max((len(p) for p in parents), default=0))


class TreeAuto:
    """Picks chain or tree per round over a `GammaController`'s costs and learns
    what tree rounds cost and rescue (module docstring). prior_scale: a tree
    round's price over its chain pricing before one is measured."""

    def __init__(self, controller: GammaController, prior_scale: float = 1.0,
                 trees: tuple[TreeShape, ...] = TREE_CANDIDATES, prior_rescue: float = DEFAULT_RESCUE,
                 margin: float = TREE_MARGIN):
        self.controller, self.trees, self.margin = controller, trees, margin
        self.prior_scale, self.prior_rescue = prior_scale, prior_rescue
        self.scales: list[float | None] = [None] * len(controller.costs.batches)  # per batch bucket, learned
        self.rescues = _Acceptance()  # rescued (as accepted) over misses (as tried)
        self.choice: Candidate | None = None  # the last round's pick (None: it drafted nothing)
        self.picks: Counter[str] = Counter()  # rounds per pick (`Candidate.name`), for reports

    def rescue(self) -> float:
        """β: the learned rescue rate, shrunk toward the prior."""
        return self.rescues.estimate(self.prior_rescue, RESCUE_TRIALS)

    def scale(self, batch: int) -> float:
        learned = self.scales[self.controller.costs.bucket(batch)]
        return self.prior_scale if learned is None else learned

    def options(self, seq_ids: list[int], G: int, sampled: int = 0) -> list[Candidate]:
        """The chain of G drafts and every tree of 2 … γ_max nodes, priced for these rows."""
        batch, c = len(seq_ids), self.controller
        alpha = sum(c.alpha(s) for s in seq_ids) / batch
        scale = self.scale(batch)

        def seconds(spine: int, nodes: int, is_tree: bool) -> float:
            if is_tree:
                price = c.shape_cost(batch, spine, nodes, sampled) * scale
            else:
                price = c.round_cost(batch, nodes, sampled) + c.replay_s(batch, nodes, alpha)
            return max(price, MIN_SECONDS)

        chain = candidates(alpha, self.rescue(), [G], (), seconds)
        return chain + [o for o in candidates(alpha, self.rescue(), range(2, c.gamma_max + 1), self.trees, seconds)
                        if o.tree is not None]

    def choose(self, seq_ids: list[int], gammas: list[int], sampled: int = 0) -> tuple[list[int], TreeShape | None]:
        """The rows' γ and the round's tree (None: chains), from the controller's γ per row."""
        drafting = [s for s, g in zip(seq_ids, gammas) if g > 0]
        if not drafting:
            self.choice = None
            return gammas, None
        self.choice = choose(self.options(drafting, max(gammas), sampled), self.margin)
        self.picks[self.choice.name] += 1
        if self.choice.tree is None:
            return gammas, None
        return [self.choice.gamma if g > 0 else 0 for g in gammas], self.choice.tree

    def observe(self, batch: int, outcome: TreeOutcome | None, seconds: dict[str, float] | None,
                after_prefill: bool = False, sampled: int = 0) -> None:
        """A round's outcome (None: a chain round, which teaches nothing here) and
        its seconds ("round": its wall time; None or `after_prefill`: β only)."""
        if outcome is None:
            return
        if outcome.misses:
            self.rescues.add(outcome.rescued, outcome.misses)
        if seconds is None or after_prefill or seconds.get("round", 0.0) <= 0:
            return
        priced = self.controller.shape_cost(batch, outcome.spine, outcome.nodes, sampled)
        if priced > 0:
            bucket = self.controller.costs.bucket(batch)
            self.scales[bucket] = _Learned.mix_ratio(self.scales[bucket], seconds["round"] / priced)
