"""Tree drafts: a row's drafts as a tree rooted at its pending token t[m-1],
verified in one target forward (docs/design.md, "Round structure").

Indices. A row's draft tree is its node tokens in an order where every node
follows its parent, and `parents[i]`, node i's parent node, -1 for a child of
the root. Verify input 0 is the root and input i + 1 is node i
(`input_parents`), at position m - 1 + depth. A chain d_1..d_g is the tree
with parents [-1, 0, …, g - 2]: `Proposal.parents` None means every row is
one, and the round runs as it always did.

The spine is the path of first children from the root: the chain the drafter
itself followed (it absorbed those tokens; the other children are
alternatives it had computed, the next most likely tokens at a depth). After
the commit the drafter moves to the end of the accepted path's prefix that
lies on the spine (`spine_boundary`); the next round's catch-up feeds the rest.

Acceptance (`spec.tree_accept`) picks one root-to-node path per row, then
verifies that path as the chain it is (`Speculator.accept`), so every rule
keeps its chain guarantee:
- greedy: at each node, the child equal to the target's argmax there
  (`walk`): the path's tokens are then plain greedy decoding's;
- coupled: the child equal to the target's own keyed sample at the node's
  position (seed, absolute position, purpose: the chain's noise), so the
  output is plain seeded sampling's whatever the tree;
- rows whose distributions depend on the drafts (penalties, grammars): the
  spine, verified as the chain the drafter proposed; its other nodes go
  unused (lossless, no gain).
Sampled rows verified by rejection (no seed) take recursive rejection over
each node's children instead (`spec.tree_sampling`, with its proof sketch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.errors import ConfigError, InvalidRequestError


@dataclass(frozen=True)
class TreeShape:
    """widths[k]: candidates at depth k + 1 (the drafter's own draft, then the
    next most likely tokens of its distribution there, as leaves); 1 past the
    tuple. max_nodes: nodes per row at most (None: the row's γ, the verify
    positions the scheduler reserves; never more than that)."""

    widths: tuple[int, ...]
    max_nodes: int | None = None

    def __post_init__(self):
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ConfigError(f"TreeShape(widths={self.widths!r}): give one int >= 1 per depth, e.g. (2,)")
        if self.max_nodes is not None and (not isinstance(self.max_nodes, int) or self.max_nodes < 1):
            raise ConfigError(f"TreeShape(max_nodes={self.max_nodes!r}) must be None or an int >= 1")

    def budget(self, gamma: int) -> int:
        """Nodes a row drafting up to `gamma` may verify."""
        return gamma if self.max_nodes is None else min(gamma, self.max_nodes)

    def spine_length(self, gamma: int) -> int:
        """The longest spine whose tree fits the budget (its alternatives counted), at
        least one draft where the budget has room for one (`branch` then keeps fewer
        alternatives)."""
        budget = self.budget(gamma)
        length = budget
        while length > 1 and length + self.alternatives(length) > budget:
            length -= 1
        return length

    def alternatives(self, spine_length: int) -> int:
        """Nodes beside the spine of a tree with that spine."""
        return sum(w - 1 for w in self.widths[:spine_length])

    def leaf_widths(self, spine_length: int, budget: int) -> list[int]:
        """Candidates at each depth 1..spine_length of a tree of at most `budget` nodes
        (the spine's token and its alternatives): the shape's widths, shallower depths
        first where the budget runs out (what `branch` drafts)."""
        room, out = budget - spine_length, []  # alternatives the budget still takes
        for k in range(spine_length):
            width = min(self.widths[k] if k < len(self.widths) else 1, max(room, 0) + 1)
            room -= width - 1
            out.append(width)
        return out


def checked_tree(tree) -> TreeShape | None:
    """A model-free drafter's `tree=` argument: None (chains) or a TreeShape, else ConfigError."""
    if tree is not None and not isinstance(tree, TreeShape):
        raise ConfigError(f"tree={tree!r} must be None (chains of drafts) or a TreeShape, e.g. hs.TreeShape((2,))")
    return tree


def chain_parents(num_drafts: int) -> list[int]:
    """A chain's parents: [-1, 0, 1, …]."""
    return list(range(-1, num_drafts - 1))


def input_parents(parents: list[int]) -> list[int]:
    """Each verify input's parent input: -1 for input 0 (the root), p + 1 for node p's child."""
    return [-1] + [p + 1 for p in parents]


def check_parents(tokens: list[list[int]], parents: list[list[int]]) -> None:
    """An InvalidRequestError (nothing changed yet) unless each row's parents name earlier nodes."""
    if len(parents) != len(tokens):
        raise InvalidRequestError(f"the drafter gave parents for {len(parents)} rows and tokens for {len(tokens)}; "
                                  "a Proposal's parents are one list per row; no state was changed")
    for b, (row, row_parents) in enumerate(zip(tokens, parents)):
        if len(row_parents) != len(row) or any(not -1 <= p < i for i, p in enumerate(row_parents)):
            raise InvalidRequestError(f"row {b}: parents {row_parents} for {len(row)} nodes; node i's parent must "
                                      "be -1 (the pending token) or an earlier node; no state was changed")


def spine_inputs(in_parents: list[int]) -> list[int]:
    """The verify inputs of the spine: the root, then first children, as deep as they go."""
    path = [0]
    while (child := next((i for i, p in enumerate(in_parents) if p == path[-1]), None)) is not None:
        path.append(child)
    return path


def walk(in_parents: list[int], inputs: list[int], targets: list[int]) -> list[int]:
    """The path from the root down the child whose token is the target's token at its
    parent (`targets[c]`: the target's choice after input c), first such child first."""
    path = [0]
    while (child := next((i for i, p in enumerate(in_parents)
                          if p == path[-1] and inputs[i] == targets[path[-1]]), None)) is not None:
        path.append(child)
    return path


def drafts_on_spine(path: list[int], spine: list[int]) -> int:
    """How many of the path's drafts (the inputs after the root) it takes along the spine
    (`spine_inputs`) before it leaves it or ends."""
    on_spine = 0
    while on_spine + 1 < len(path) and on_spine + 1 < len(spine) and path[on_spine + 1] == spine[on_spine + 1]:
        on_spine += 1
    return on_spine


def spine_boundary(path: list[int], in_parents: list[int], start_len: int) -> int:
    """The computed length the drafter commits to: the round start's, the root, and the path's
    leading inputs that lie on the spine (what the drafter absorbed of the accepted tokens)."""
    return start_len + 1 + drafts_on_spine(path, spine_inputs(in_parents))


def branch(spine: list[int], q: torch.Tensor, shape: TreeShape,
           budget: int) -> tuple[list[int], list[int], list[int]]:
    """A drafter's tree of at most `budget` nodes from its spine d_1..d_L and its
    distributions there, q [≥ L, vocab] (probabilities or logits: only their order
    is read): at depth k the spine's token, then the widths[k-1] - 1 most likely
    others as leaves, shallower depths first where the budget runs out. Returns
    (tokens, parents, the row of q each node was drawn from)."""
    widest = max(shape.widths)
    ranked = [torch.topk(q[k], min(widest + 1, q.shape[-1])).indices.tolist() for k in range(len(spine))]
    return branch_ranked(spine, ranked, shape, budget)


def branch_rows(spines: list[list[int]], q: torch.Tensor, gammas: list[int],
                shape: TreeShape) -> tuple[list[list[int]], torch.Tensor, list[list[int]]]:
    """Each row's spine branched (`branch`) within its γ's budget, from q [batch, ≥ L, vocab]
    (its distributions along the spine): (tokens [batch][n_b], q of each node [batch, nodes,
    vocab], parents [batch][n_b]), what a drafter that branches from q proposes."""
    trees = [branch(spine, q[b], shape, shape.budget(g)) if spine else ([], [], [])
             for b, (spine, g) in enumerate(zip(spines, gammas))]
    width = max(len(tokens) for tokens, _, _ in trees)
    probs = q.new_zeros(len(trees), width, q.shape[2])  # [batch, nodes, vocab]
    for b, (_, _, drawn_from) in enumerate(trees):
        probs[b, :len(drawn_from)] = q[b, drawn_from]
    return [t for t, _, _ in trees], probs, [p for _, p, _ in trees]


def branch_ranked(spine: list[int], ranked: list[list[int]], shape: TreeShape,
                  budget: int) -> tuple[list[int], list[int], list[int]]:
    """`branch` over candidates the drafter ranked itself: ranked[k], the tokens it
    would put at depth k + 1, best first (the spine's token among them or not; a
    model-free drafter's most frequent continuations). Returns (tokens, parents,
    the depth - 1 each node was drawn at)."""
    tokens, parents, rows, parent = [], [], [], -1
    # alternatives the budget still takes, shallower depths first (`TreeShape.leaf_widths`'s rule)
    room = budget - len(spine)
    for k, token in enumerate(spine):
        tokens.append(token)
        parents.append(parent)
        rows.append(k)
        here = len(tokens) - 1
        width = min(shape.widths[k] if k < len(shape.widths) else 1, room + 1)
        others = list(dict.fromkeys(t for t in ranked[k] if t != token))[:width - 1] if width > 1 else []
        room -= len(others)
        for other in others:
            tokens.append(other)
            parents.append(parent)
            rows.append(k)
        parent = here
    return tokens, parents, rows


def fitted_tree(spine: list[int], ranked: list[list[int]], shape: TreeShape,
                budget: int) -> tuple[list[int], list[int]]:
    """A model-free drafter's tree (tokens, parents): its spine cut to the longest
    prefix whose alternatives above its last depth (ranked[k] other than the spine's
    token, up to widths[k] - 1 at depth k + 1) fit the budget beside it, then branched
    (`branch_ranked`: its last depth's alternatives take the room left). A drafter
    that found no alternative keeps its whole spine."""
    def alternatives(depths: int) -> int:
        return sum(min((shape.widths[k] if k < len(shape.widths) else 1) - 1, len(set(ranked[k]) - {spine[k]}))
                   for k in range(depths))

    length = min(len(spine), budget)
    while length > 1 and length + alternatives(length - 1) > budget:
        length -= 1
    tokens, parents, _ = branch_ranked(spine[:length], ranked, shape, budget)
    return tokens, parents


def tree_parents(trees: list[tuple[list[int], list[int]]]) -> list[list[int]] | None:
    """`Proposal.parents` of rows' (tokens, parents): None where every row is a chain
    (the round then runs as a chain round, under the checkpoint policy)."""
    if all(parents == chain_parents(len(tokens)) for tokens, parents in trees):
        return None
    return [parents for _, parents in trees]
