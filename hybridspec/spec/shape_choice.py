"""Chain or tree: the draft shape with the most tokens per second, a tree only by a margin.

Candidates are chains of γ drafts and trees (`TreeShape`) of at most γ nodes
for each γ offered. Each is priced by what its round runs: the drafter steps
its spine (a chain's γ drafts, a tree's shorter spine) and the target's
forward reads every node (γ + 1 verify inputs per row, for a chain and a tree
alike), at the batch's costs (`round_seconds`, measured or roofline; a tree
forward may cost more than a chain's of as many inputs: the callback says
which it prices). Tokens per round are the closed forms: `expected_tokens`
for a chain, `tree_expected_tokens` for a tree (α, and β the rescue rate of
its alternatives: `costs.tree_form`).

`choose` keeps the best chain unless the best tree's goodput beats it by more
than `margin`: the figures a tree rests on (β, and a tree forward's price)
are less certain than a chain's, and a tree that merely ties gives up depth
for nothing. Where the verify forward's cost grows with its inputs (large
batches, compute-bound), the spine a tree gives up costs more than its leaves
win, so chains are chosen there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hybridspec.costs.closed_form import expected_tokens
from hybridspec.costs.tree_form import tree_expected_tokens
from hybridspec.errors import ConfigError
from hybridspec.spec.tree import TreeShape

TREE_CANDIDATES = (TreeShape((2,)), TreeShape((2, 2)), TreeShape((3,)))
TREE_MARGIN = 0.05  # a tree must beat the best chain's goodput by this fraction

# round_seconds(spine drafts, nodes, is_tree) -> seconds of one round of the batch
RoundSeconds = Callable[[int, int, bool], float]


@dataclass(frozen=True)
class Candidate:
    """One draft shape at one γ: its expected tokens per row and round, and its round's seconds."""

    gamma: int
    tree: TreeShape | None  # None: a chain of γ drafts
    tokens: float
    seconds: float

    @property
    def goodput(self) -> float:
        """Tokens per second per row."""
        return self.tokens / self.seconds

    @property
    def name(self) -> str:
        shape = "chain" if self.tree is None else "tree " + ",".join(map(str, self.tree.widths))
        return f"{shape} γ={self.gamma}"


def tree_widths(tree: TreeShape, gamma: int) -> list[int]:
    """Candidates per spine depth of the tree a drafter proposes at γ (`TreeShape.leaf_widths`)."""
    return tree.leaf_widths(tree.spine_length(gamma), tree.budget(gamma))


def candidates(alpha: float, rescue: float, gammas: Sequence[int], trees: Sequence[TreeShape],
               round_seconds: RoundSeconds) -> list[Candidate]:
    """Each γ's chain and each tree at that γ (a tree no different from the chain is left out)."""
    out = []
    for gamma in gammas:
        out.append(Candidate(gamma, None, expected_tokens(alpha, gamma), round_seconds(gamma, gamma, False)))
        for tree in trees:
            widths = tree_widths(tree, gamma)
            if max(widths, default=1) > 1:
                out.append(Candidate(gamma, tree, tree_expected_tokens(alpha, widths, rescue),
                                     round_seconds(len(widths), sum(widths), True)))
    return out


def choose(options: Sequence[Candidate], margin: float = TREE_MARGIN) -> Candidate:
    """The best chain, or the best tree where its goodput exceeds the chain's by more than `margin`."""
    chains = [c for c in options if c.tree is None]
    if not chains:
        raise ConfigError("choose needs at least one chain candidate to compare trees with; "
                          "pass candidates(...) with at least one γ")
    if not margin >= 0:
        raise ConfigError(f"margin={margin!r} must be a fraction >= 0, e.g. 0.05")
    chain = max(chains, key=lambda c: (c.goodput, -c.gamma))  # fewer drafts on ties
    trees = [c for c in options if c.tree is not None]
    tree = max(trees, key=lambda c: c.goodput, default=None)
    return tree if tree is not None and tree.goodput > (1.0 + margin) * chain.goodput else chain
