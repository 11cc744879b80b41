"""`TreePlan`: the indices of one forward over a tree of inputs, worked out
once on the host and shared by every layer (as `kernels.slot_plan.SlotPlan`
is for a chain); plain bookkeeping, which the tree forms of the kernels
(`kernels/triton/tree_verify.py`) read, and the Triton tree kernels as
tensors made once per forward (`parent_index`, `num_tokens`, `ancestor_bits`).

A tree forward's inputs are a sequence's pending token (input 0, the root)
and draft nodes, in an order where every node comes after its parent:
`parents[b][t]` is the input index of input t's parent, -1 for the root,
whose parent is the ring head (the state before the forward). A chain is the
tree with parents [-1, 0, 1, …]. Input t sits at depth `depths[b][t]` (the
root at 0) and at position start + depth; it sees the committed context and
its ancestors, itself included, nothing else.

The recurrences (`tree_verify`) step by depth level: level d holds
every live input of depth d in every row, and each one's state comes from
its parent's, so a tree of depth D costs D + 1 batched steps, whatever its
width. States live in a buffer [batch · (T + 1), ...] whose entry b·(T + 1)
is row b's head state and b·(T + 1) + 1 + t the state after input t.
"""
from __future__ import annotations

import functools

import torch


def depths_of(parents: list[int]) -> list[int]:
    """Each input's depth (the root's 0) from its parent indices."""
    depths: list[int] = []
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"input {t}'s parent {p} must be -1 (the root's) or an earlier input in [0, {t})")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


class TreePlan:
    """parents [batch][num_tokens[b]] per row (see the module docstring), rows
    right-padded to T inputs; padding inputs take part in nothing."""

    def __init__(self, parents: list[list[int]], device):
        self.device = torch.device(device)
        self.parents = [list(p) for p in parents]
        self.batch = len(self.parents)
        self.num_inputs = max(map(len, self.parents), default=0)
        self.depths = [depths_of(p) for p in self.parents]

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def positions(self, start_lens: list[int]) -> torch.Tensor:  # [batch, T] start + depth (padding: start)
        T = self.num_inputs
        return self._tensor([[s + d for d in depths] + [s] * (T - len(depths))
                             for s, depths in zip(start_lens, self.depths)]).view(self.batch, T)

    @functools.cached_property
    def levels(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per depth: (inputs b·T + t, their parents' states b·(T + 1) + parent + 1,
        their own states b·(T + 1) + t + 1), each [inputs of that depth]."""
        T, by_depth = self.num_inputs, {}
        for b, (parents, depths) in enumerate(zip(self.parents, self.depths)):
            for t, (p, d) in enumerate(zip(parents, depths)):
                by_depth.setdefault(d, []).append((b * T + t, b * (T + 1) + p + 1, b * (T + 1) + t + 1))
        return [tuple(self._tensor(list(column)) for column in zip(*by_depth[d])) for d in sorted(by_depth)]

    @functools.cached_property
    def parent_index(self) -> torch.Tensor:  # [batch, T] int64: each input's parent input (-1: the head; padding -1)
        T = self.num_inputs
        return self._tensor([p + [-1] * (T - len(p)) for p in self.parents]).view(self.batch, T)

    @functools.cached_property
    def num_tokens(self) -> torch.Tensor:  # [batch] int64: each row's inputs
        return self._tensor([len(p) for p in self.parents])

    @functools.cached_property
    def ancestor_bits(self) -> torch.Tensor:
        """[batch, T] int64: bit s of input t's entry set when input t sees input s (`visible` as
        bitmasks, for T <= 64; bit 63 is the sign bit); padding inputs 0."""
        if self.num_inputs > 64:
            raise ValueError(f"a tree of {self.num_inputs} inputs has no 64-bit ancestor masks; "
                             "use `visible` for trees of more than 64 inputs")
        rows = []
        for parents in self.parents:
            bits = []
            for t, p in enumerate(parents):
                bits.append((bits[p] if p >= 0 else 0) | 1 << t)
            rows.append([v - (1 << 64) if v >= 1 << 63 else v for v in bits] + [0] * (self.num_inputs - len(bits)))
        return self._tensor(rows).view(self.batch, self.num_inputs)

    @functools.cached_property
    def visible(self) -> list[torch.Tensor]:
        """Per row, [n, n] bool: input t sees input s (s is t or an ancestor of t)."""
        out = []
        for parents in self.parents:
            n = len(parents)
            seen = [[False] * n for _ in range(n)]
            for t, p in enumerate(parents):
                seen[t] = list(seen[p]) if p >= 0 else [False] * n
                seen[t][t] = True
            out.append(self._tensor(seen, torch.bool).view(n, n))
        return out

    def spine(self, b: int) -> list[int]:
        """Row b's spine: the root, then each input's first child, as deep as they go (the
        drafter's own chain, `spec.tree`)."""
        path = [0]
        while (child := next((i for i, p in enumerate(self.parents[b]) if p == path[-1]), None)) is not None:
            path.append(child)
        return path

    def path_to(self, b: int, t: int) -> list[int]:
        """Row b's inputs from the root to input t, both included."""
        path = [t]
        while self.parents[b][path[-1]] >= 0:
            path.append(self.parents[b][path[-1]])
        return path[::-1]
