"""`PrefixIndex`: the bookkeeping of the prefix cache, a radix tree over
committed tokens whose nodes are KV pages, with saved states (a sequence's
recurrent state saved at a position) hung on the node that holds their
position. Plain Python, no tensors: page ids, token tuples, saved-state
entries, lock counts and an LRU clock.

Terms
  node         one KV page of a cached prefix: `tokens` (1 .. block_size of them; fewer
               only on a last, partial page), the positions [start, start + len(tokens)),
               `page` (None for a model without attention layers). Its children are the
               pages that follow it, keyed by their tokens; a partial node has none.
  hit          the longest prefix of a prompt the tree holds, to the token: full pages
               by exact key, then the child sharing most tokens with the rest of the
               prompt, which may end inside its page (the page is shared, and the first
               write past the hit copies it: `PagedKVCache` copy-on-write).
  saved state  the recurrent state (`SlotState`) after `position` tokens of the path,
               kept on the node holding position - 1. A saved state is valid for a
               prompt iff the prompt's first `position` tokens are the path's, so a
               partial sibling's saved states count as far as the prompt agrees with it.
  lock         a prompt being restored and replayed holds the deepest node of its hit and
               the saved state it restores from; locked nodes and saved states are never
               evicted (only leaves are evicted, so a locked node keeps its ancestors too).

Why a token radix tree rather than chained hashes of full pages (vLLM's
block hashes): a hash names only a full page, so a shared prefix that ends
inside a page, or a prompt sent twice whose last page is partial, loses that
page; Mamba state makes this worse, because a saved state is only usable where
the index can say "these exact tokens". Comparing tokens gives a hit at any
position, saved states at any position, and a cheap walk (one dictionary lookup
per full page).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class SavedState:
    """A saved state: `state` after the first `position` tokens of `node`'s path."""

    position: int
    state: Any  # SlotState (tensors); the index never looks inside
    nbytes: int
    node: "Node"
    lock_count: int = 0
    last_access: int = 0


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    start: int  # position of tokens[0]
    page: int | None
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    saved_states: dict[int, SavedState] = field(default_factory=dict)  # position -> saved state
    lock_count: int = 0
    last_access: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class PrefixMatch:
    """What the tree holds of a prompt: `num_cached` tokens in the pages of `nodes`
    (one per page, root excluded) and the valid saved states at or before it."""

    num_cached: int
    nodes: list[Node]
    saved_states: list[SavedState]

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]

    def nearest_saved_state(self, limit: int) -> SavedState | None:
        """The saved state of largest position <= limit, or None."""
        usable = [c for c in self.saved_states if c.position <= limit]
        return max(usable, key=lambda c: c.position, default=None)

    def nodes_for(self, num_tokens: int, block_size: int) -> list[Node]:
        """The nodes whose pages hold positions [0, num_tokens)."""
        return self.nodes[: -(-num_tokens // block_size)]


class PrefixIndex:
    """The radix tree of one model's cache (pages of `block_size` tokens)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = Node((), 0, None, None)
        self._clock = itertools.count(1)

    # -- lookup -------------------------------------------------------------------------------

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens` and every saved state valid for them."""
        node, pos, nodes, saved_states = self.root, 0, [], []
        while pos < len(tokens):
            chunk = tuple(tokens[pos:pos + self.block_size])
            best, best_len = None, 0
            for child in node.children.values():
                n = common_prefix_len(child.tokens, chunk)
                saved_states += [c for p, c in child.saved_states.items() if p - child.start <= n]
                if n > best_len:
                    best, best_len = child, n
            if best is None:
                break
            nodes.append(best)
            pos += best_len
            if best_len < self.block_size or len(best.tokens) < self.block_size:
                break
            node = best
        return PrefixMatch(pos, nodes, saved_states)

    def touch(self, nodes: list[Node], saved: SavedState | None = None) -> None:
        now = next(self._clock)
        for n in nodes:
            n.last_access = now
        if saved is not None:
            saved.last_access = now

    # -- insertion ----------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int | None]) -> tuple[list[Node], list[int]]:
        """Index `tokens` held in `pages` (one per block_size tokens). Returns the path of
        nodes (one per page) and the pages newly taken into the tree: the caller adds a
        holder to each. Pages the tree already holds for the same tokens are kept."""
        node, path, taken = self.root, [], []
        for i, start in enumerate(range(0, len(tokens), self.block_size)):
            chunk = tuple(tokens[start:start + self.block_size])
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = Node(chunk, start, pages[i], node)
                if pages[i] is not None:
                    taken.append(pages[i])
            path.append(child)
            node = child
        self.touch(path)
        return path, taken

    def add_saved_state(self, node: Node, position: int, state, nbytes: int) -> SavedState | None:
        """Hang a saved state at `position` on `node`; None if one is there already (touched)."""
        if not node.start < position <= node.end:
            raise ValueError(f"a saved state at {position} belongs to the node holding position {position - 1}, "
                             f"not to the one of positions [{node.start}, {node.end})")
        if position in node.saved_states:
            self.touch([], node.saved_states[position])
            return None
        saved = node.saved_states[position] = SavedState(position, state, nbytes, node)
        self.touch([], saved)
        return saved

    # -- locks --------------------------------------------------------------------------------

    def lock(self, nodes: list[Node], saved: SavedState | None, delta: int = 1) -> None:
        for n in nodes:
            n.lock_count += delta
        if saved is not None:
            saved.lock_count += delta

    # -- eviction -----------------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack += n.children.values()
        return out

    def saved_states(self) -> list[SavedState]:
        return [c for n in self.nodes() for c in n.saved_states.values()]

    def evictable_leaf(self, worth=None) -> Node | None:
        """The least recently used unlocked leaf holding no locked saved state (and, with
        `worth`, for which `worth(node)` holds)."""
        leaves = [n for n in self.nodes() if not n.children and n.lock_count == 0
                  and all(c.lock_count == 0 for c in n.saved_states.values()) and (worth is None or worth(n))]
        return min(leaves, key=lambda n: n.last_access, default=None)

    def evictable_saved_state(self) -> SavedState | None:
        """The least recently used unlocked saved state."""
        free = [c for c in self.saved_states() if c.lock_count == 0]
        return min(free, key=lambda c: c.last_access, default=None)

    def remove_leaf(self, node: Node) -> list[SavedState]:
        """Drop a leaf from the tree; returns its saved states (the caller frees them and the page)."""
        if node.children or node.parent is None:
            raise ValueError("only a leaf below the root can be removed")
        del node.parent.children[node.tokens]
        dropped = list(node.saved_states.values())
        node.saved_states.clear()
        return dropped

    def remove_saved_state(self, saved: SavedState) -> None:
        del saved.node.saved_states[saved.position]
