"""`HiddenStates`: the target's hidden states at chosen points of its layer
stack, per sequence and position, for a drafter that reads them (MTP layers,
EAGLE-3 heads).

A drafter that reads hidden states owns one of these and names its points;
the target's cache it is paired with (`HybridCache.hidden`) records into it
from every forward of the target over that cache: prefill, plain steps,
verification, token replay. What a forward writes is **pending** until the
cache moves the sequence: `HybridCache.commit_forward` and `commit` keep the
rows below the new computed length (the accepted ones) and drop the rest,
`rewind_to` and `abort_forward` drop what lies past the length they go back
to. The drafter reads (`take`) only kept rows, so it never sees the hidden
state of a rejected token.

A tree verify (`spec.tree`) writes one row per verify input, in tree order:
its rows stay pending until the round knows each sequence's accepted path,
then `follow_path` lays the path's inputs out as the rows at positions
start, start + 1, … (the accepted tokens' own, in order), and the commit
keeps them as it keeps a chain's.

Points: point i is the residual stream entering decoder layer i; point L (the
number of layers) is the last layer's output, before the final norm (what an
MTP layer reads). EAGLE-3 reads three points, low, middle and high.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridspec.errors import ConfigError

MAX_PIECES = 64  # kept views per sequence before they are joined (each holds its forward's whole capture)


@dataclass
class HiddenCapture:
    """What one forward records: `points` (sorted, each in 0..num_layers) and,
    once it ran, `values` [batch, T, len(points), hidden] of every input
    (padding included), whichever path computed it."""

    points: tuple[int, ...]
    values: torch.Tensor | None = None


class HiddenStates:
    """Hidden states of committed positions, per sequence, until a drafter takes them."""

    def __init__(self, points: tuple[int, ...], num_layers: int):
        points = tuple(sorted(set(points)))
        if not points or not all(isinstance(p, int) and 0 <= p <= num_layers for p in points):
            raise ConfigError(f"hidden-state points {points} must be integers in [0, {num_layers}] (point i enters "
                              f"layer i; {num_layers} is the last layer's output)")
        self.points = points
        self._ready: dict[int, tuple[int, list[torch.Tensor]]] = {}  # seq -> (first position, rows [n, k, hidden])
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}  # seq -> (first position, rows of the open forward)

    def capture(self) -> HiddenCapture:
        """A forward's capture of these points."""
        return HiddenCapture(self.points)

    def put(self, seq_ids: list[int], start_lens: list[int], num_new: list[int], values: torch.Tensor) -> None:
        """A forward's rows, pending: row b's inputs 0..num_new[b]-1 sit at positions
        start_lens[b]...; `values` [batch, T, k, hidden]."""
        for b, (s, start, n) in enumerate(zip(seq_ids, start_lens, num_new)):
            self._pending[s] = (start, values[b, :n])

    def follow_path(self, seq_id: int, path: list[int]) -> None:
        """The pending rows of a tree forward become those of `path` (the accepted path's
        verify inputs from the root, input 0), in order: row k is input path[k]'s."""
        pending = self._pending.get(seq_id)
        if pending is None:
            return
        start, rows = pending  # rows [inputs, k, hidden] in tree order
        self._pending[seq_id] = (start, rows[torch.tensor(path, device=rows.device)])

    def commit(self, seq_id: int, length: int) -> None:
        """The sequence's computed length is now `length`: the pending rows below it are kept."""
        pending = self._pending.pop(seq_id, None)
        if pending is None:
            return
        start, rows = pending
        first, kept = self._ready.get(seq_id, (start, []))
        end = first + sum(len(r) for r in kept)
        if start > end:  # positions the cache restored without a forward (a prefix hit): start again after them
            first, kept, end = start, [], start
        rows = rows[end - start:max(end - start, length - start)]  # rows already kept (a replay) come once
        if len(rows):  # a view of its forward's capture, which nothing writes again
            kept = kept + [rows]
            if len(kept) > MAX_PIECES:  # a row that drafts rarely: its pieces in one tensor, the captures freed
                kept = [torch.cat(kept)]
        self._ready[seq_id] = (first, kept)

    def rewind(self, seq_id: int, length: int) -> None:
        """Back to computed length `length`: everything at or past it goes."""
        self._pending.pop(seq_id, None)
        if seq_id not in self._ready:
            return
        first, kept = self._ready[seq_id]
        rows = torch.cat(kept) if kept else None
        if rows is None or length <= first:
            self._ready[seq_id] = (min(first, length), [])
        else:
            self._ready[seq_id] = (first, [rows[:length - first]])

    def take(self, seq_id: int) -> tuple[int, torch.Tensor | None]:
        """(position of the first row, rows [n, k, hidden] or None) of the kept
        rows not taken before; they are gone from here afterwards."""
        first, kept = self._ready.get(seq_id, (0, []))
        if not kept:
            return first, None
        rows = torch.cat(kept) if len(kept) > 1 else kept[0]
        self._ready[seq_id] = (first + len(rows), [])
        return first, rows

    def drop(self, seq_ids: list[int]) -> None:
        """Forget these sequences."""
        for s in seq_ids:
            self._ready.pop(s, None)
            self._pending.pop(s, None)
