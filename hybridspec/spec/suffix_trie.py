"""`SuffixTrie`: the occurrence count of every n-gram (n <= depth) of the
token streams put in it, kept incrementally: the structure behind
`SuffixDrafter` (`spec.suffix_drafter`).

A node is an n-gram, its path from the root; `count` is how often it
occurred, `total` how often a token followed it (the sum of its children's
counts), `best` its most frequent continuation (ties: the smaller token id,
so the trie's answers depend on its counts alone, never on insertion order).

A stream grows one token at a time (`append`): the n-grams that end at the
new token are one step below the n-grams that ended at the previous one (the
stream's frontier), so an append touches `depth` nodes whatever the stream's
length. `add` and `remove` put in or take out a whole stream, walking the
n-grams that start at each position (one root path of `depth` nodes each);
removing leaves the counts exactly as if the stream had never been added.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

EDGE_STRIDE = 1 << 32  # an edge's key is parent * EDGE_STRIDE + token: one int per edge (token ids < 2**32)
ROOT = 0


@dataclass
class Frontier:
    """Where a stream ends in a trie: `nodes[k]` is the n-gram of its last k
    tokens (k = 0 .. depth - 1; `nodes[0]` is the root), `length` how many
    tokens it has taken."""

    nodes: list[int] = field(default_factory=lambda: [ROOT])
    length: int = 0


@dataclass(frozen=True)
class Draft:
    """A continuation found in the trie: its tokens, their cumulative empirical
    probabilities summed (the expected number the target accepts if the counts
    were its distribution), and the length of the n-gram it continues."""

    tokens: list[int]
    score: float
    match: int


NO_DRAFT = Draft([], 0.0, 0)


class SuffixTrie:
    """Counts of the n-grams (1 <= n <= `depth`) of the streams put in it."""

    def __init__(self, depth: int):
        self.depth = depth
        self.edges: dict[int, int] = {}  # parent * EDGE_STRIDE + token -> child
        self.token = [-1]  # per node: the token on the edge into it
        self.count = [0]  # per node: occurrences of its n-gram
        self.total = [0]  # per node: occurrences followed by a token (sum of the children's counts)
        self.best = [-1]  # per node: the child with the largest count (ties: smaller token), -1: none
        self.first = [-1]  # per node: a child, -1: none ...
        self.sibling = [-1]  # ... and the next child of the same parent: children are listed for `remove`
        self.free: list[int] = []  # node ids `remove` emptied, reused first

    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root included."""
        return len(self.token) - len(self.free)

    # -- growing ---------------------------------------------------------------------------------

    def append(self, frontier: Frontier, token: int) -> None:
        """One more token of the stream ending at `frontier`: every n-gram that
        ends at it counts once more; `frontier` moves to it."""
        grown = [self._increment(node, token) for node in frontier.nodes]
        frontier.nodes = [ROOT] + grown[:self.depth - 1]
        frontier.length += 1

    def extend(self, frontier: Frontier, tokens) -> None:
        for token in tokens:
            self.append(frontier, token)

    def add(self, tokens: list[int]) -> None:
        """Count every n-gram of `tokens` once."""
        self.extend(Frontier(), tokens)

    def remove(self, tokens: list[int]) -> None:
        """Uncount every n-gram of `tokens`, added earlier with `add` (or
        streamed in whole); nodes left with no occurrence are freed. By start
        position, first to last: what is left at each step is the n-grams of
        the other streams and of a suffix of `tokens`, so a child never
        outcounts its parent and a node freed has no child left."""
        for start in range(len(tokens)):
            path = [ROOT]
            for token in tokens[start:start + self.depth]:
                path.append(self.edges[path[-1] * EDGE_STRIDE + token])
            for depth in range(len(path) - 1, 0, -1):  # deepest first: a child is gone before its parent
                self._decrement(path[depth - 1], path[depth])

    def _increment(self, parent: int, token: int) -> int:
        key = parent * EDGE_STRIDE + token
        child = self.edges.get(key)
        if child is None:
            child = self._new_node(parent, token)
            self.edges[key] = child
        count = self.count[child] = self.count[child] + 1
        self.total[parent] += 1
        best = self.best[parent]
        if best < 0 or count > self.count[best] or (count == self.count[best] and token < self.token[best]):
            self.best[parent] = child
        return child

    def _decrement(self, parent: int, child: int) -> None:
        self.count[child] -= 1
        self.total[parent] -= 1
        if self.count[child] == 0:
            self._unlink(parent, child)
        if self.best[parent] == child:  # its count fell: another child may lead now
            self.best[parent] = self._most_frequent_child(parent)

    def _new_node(self, parent: int, token: int) -> int:
        if self.free:
            node = self.free.pop()
            self.token[node], self.count[node], self.total[node], self.best[node] = token, 0, 0, -1
            self.first[node] = -1
        else:
            node = len(self.token)
            self.token.append(token)
            self.count.append(0)
            self.total.append(0)
            self.best.append(-1)
            self.first.append(-1)
            self.sibling.append(-1)
        self.sibling[node], self.first[parent] = self.first[parent], node
        return node

    def _unlink(self, parent: int, child: int) -> None:
        del self.edges[parent * EDGE_STRIDE + self.token[child]]
        if self.first[parent] == child:
            self.first[parent] = self.sibling[child]
        else:
            node = self.first[parent]
            while self.sibling[node] != child:
                node = self.sibling[node]
            self.sibling[node] = self.sibling[child]
        self.free.append(child)

    def _most_frequent_child(self, parent: int) -> int:
        best, node = -1, self.first[parent]
        while node >= 0:
            if best < 0 or (self.count[node], -self.token[node]) > (self.count[best], -self.token[best]):
                best = node
            node = self.sibling[node]
        return best

    # -- reading ---------------------------------------------------------------------------------

    def find(self, tokens: list[int]) -> int:
        """The node of n-gram `tokens` (len <= depth), or -1 if it never occurred."""
        node = ROOT
        for token in tokens:
            node = self.edges.get(node * EDGE_STRIDE + token, -1)
            if node < 0:
                return -1
        return node

    def continuation(self, node: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of `node`'s n-gram, token by token,
        while the path's empirical probability (the product of each step's
        count / total) stays at or above `min_prob`, at most `limit` tokens:
        (tokens, the sum of the path's probabilities after each token)."""
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and self.total[node]:
            child = self.best[node]
            prob *= self.count[child] / self.total[node]
            if prob < min_prob:
                break
            tokens.append(self.token[child])
            score += prob
            node = child
        return tokens, score

    def alternatives(self, node: int, spine: list[int], min_prob: float, limit: int) -> list[list[int]]:
        """Along `spine`, a continuation of `node`'s n-gram: at each depth k the `limit`
        tokens that most often followed the n-gram of the spine's first k tokens there
        (ties: the smaller token), each while its path's empirical probability stays at or
        above `min_prob` (the spine's own token among them). Reads every child of the
        spine's nodes: at most the distinct tokens that ever followed them."""
        ranked, prob = [], 1.0
        for token in spine:
            children, child = [], self.first[node]
            while child >= 0:
                children.append(child)
                child = self.sibling[child]
            best = heapq.nsmallest(limit, children, key=lambda c: (-self.count[c], self.token[c]))
            ranked.append([self.token[c] for c in best if prob * self.count[c] / self.total[node] >= min_prob])
            nxt = self.edges[node * EDGE_STRIDE + token]
            prob *= self.count[nxt] / self.total[node]
            node = nxt
        return ranked

    def best_draft(self, matches: list[int], limit: int, min_prob: float) -> Draft:
        """Of the continuations of `matches` (matches[k]: the node of the
        context's last k tokens, -1: none; k >= 1), the one with the best score;
        ties go to the longer match."""
        found = NO_DRAFT
        for k in range(len(matches) - 1, 0, -1):
            node = matches[k]
            if node < 0 or not self.total[node]:
                continue
            tokens, score = self.continuation(node, limit, min_prob)
            if tokens and score > found.score:
                found = Draft(tokens, score, k)
        return found

    def ngram_counts(self) -> dict[tuple[int, ...], int]:
        """Every n-gram held and its count (tests compare tries by it)."""
        counts, stack = {}, [(ROOT, ())]
        while stack:
            node, gram = stack.pop()
            child = self.first[node]
            while child >= 0:
                counts[gram + (self.token[child],)] = self.count[child]
                stack.append((child, gram + (self.token[child],)))
                child = self.sibling[child]
        return counts
