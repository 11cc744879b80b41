"""State pool: recurrent-state storage of every Mamba layer, a ring of slots per sequence.

Terms
  slot   one copy of a layer's state: SSM state plus conv window
  ring   the `ring_slots` slots a sequence owns, the same slot indices in
         every Mamba layer: ring r holds slots r, r + S, …, r + (R-1)*S for
         S = max_seqs (offset-major: offset k of every ring is one block, so
         the slots of consecutive rings at one offset form a contiguous span
         that a batched step reads and writes in place)
  head   the slot holding the state at the sequence's boundary; the model
         reads and advances it, the checkpoint policy writes snapshots into the
         other slots of the ring and moves the head on restore (no copy)

Storage per Mamba layer, slot-major and contiguous:
  ssm_states[layer]   [max_seqs * R, *ssm_shape]   (nheads, headdim, d_state) Mamba2 | (d_inner, d_state) Mamba1
  conv_states[layer]  [max_seqs * R, *conv_shape]  (conv_dim, d_conv - 1)
This module keeps which ring a sequence owns, where its head is and the
position of the state the head holds (for the boundary invariant); snapshot
placement and restore are `ring.py` and `restore.py`, run by `Checkpointer`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

from hybridspec.errors import CacheFullError
from hybridspec.kernels import huge_pages
from hybridspec.cache.state_specs import RecurrentStateShape, RecurrentStateSpec, bytes_per_slot


def _as_state_spec(spec: RecurrentStateSpec | Sequence[Sequence[int]]) -> RecurrentStateSpec:
    """A layer kind's `RecurrentStateSpec`, or a plain `(ssm shape, conv shape)` pair."""
    if isinstance(spec, RecurrentStateSpec):
        return spec
    ssm, conv = spec
    return RecurrentStateShape(tuple(ssm), tuple(conv))


@dataclass(frozen=True)
class SlotState:
    """A copy of one slot in every Mamba layer, held outside the pool (a prefix cache's saved state)."""

    ssm: tuple[torch.Tensor, ...]  # per layer [*ssm_shape]
    conv: tuple[torch.Tensor, ...]  # per layer [*conv_shape]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.ssm, *self.conv))


@dataclass(frozen=True)
class StatePoolBookkeeping:
    """A copy of the pool's indices, comparable with `==` ("the pool is unchanged")."""

    free_rings: tuple[int, ...]  # ascending (the order they are taken in)
    rings: dict[int, int]  # seq_id -> ring index
    heads: dict[int, int]  # seq_id -> absolute head slot
    head_positions: dict[int, int]  # seq_id -> position of the state in the head slot


class StatePool:
    def __init__(
        self,
        layer_shapes: Sequence[RecurrentStateSpec | tuple[tuple[int, ...], tuple[int, ...]]],
        max_seqs: int,
        ring_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_seqs < 1:
            raise ValueError(f"max_seqs={max_seqs}: the state pool needs room for at least one sequence")
        if ring_slots < 1:
            raise ValueError(f"ring_slots={ring_slots}: a ring needs at least one slot (the head)")
        self.layer_shapes = tuple(_as_state_spec(spec) for spec in layer_shapes)
        self.max_seqs = max_seqs
        self.num_ring_slots = ring_slots
        self.dtype = dtype
        num_slots = max_seqs * ring_slots
        # on CPU in huge pages: a decode step reads and writes every running sequence's states
        states = huge_pages.zeros([((num_slots, *s.ssm), dtype) for s in self.layer_shapes]
                                  + [((num_slots, *s.conv), dtype) for s in self.layer_shapes], torch.device(device))
        self.ssm_states, self.conv_states = states[:len(self.layer_shapes)], states[len(self.layer_shapes):]
        self._free_rings: list[int] = list(range(max_seqs))  # a heap: the lowest free ring is taken first
        self._backed_rings: set[int] = set()  # rings handed out before: every slot of theirs written once
        self._rings: dict[int, int] = {}
        self._heads: dict[int, int] = {}
        self._head_positions: dict[int, int] = {}

    @property
    def num_free_rings(self) -> int:
        return len(self._free_rings)

    @property
    def bytes_per_slot(self) -> int:
        """SSM state plus conv window of one slot, over every Mamba layer."""
        return bytes_per_slot(self.layer_shapes, self.dtype.itemsize)

    def check_admission(self, num_new_seqs: int) -> None:
        if num_new_seqs > len(self._free_rings):
            raise CacheFullError(
                f"{num_new_seqs} new sequences need a state ring each but only {len(self._free_rings)} "
                f"of {self.max_seqs} rings are free; raise max_seqs or run a smaller batch"
            )

    def add_sequence(self, seq_id: int) -> int:
        """Give `seq_id` a ring whose head, its base slot, holds the zero state;
        returns that slot. Only the head is zeroed: the ring's other slots are
        written before they are read (snapshots within a round; outside one no
        slot but the head holds anything), and zeroing them costs a fresh
        request a noticeable share of its generate. The first time a ring is
        handed out, though, all its slots are written once: the pool is fresh
        memory whose pages the OS backs on their first write, and those first
        writes, left to the first round's snapshots, made that round's forward
        several times its warm cost (docs/results/llamacpp.md), a cost that
        adaptive γ then learned as the price of drafting."""
        if seq_id in self._rings:
            raise ValueError(f"sequence {seq_id} already owns a state ring; free it first or use a new id")
        self.check_admission(1)
        ring = heapq.heappop(self._free_rings)  # lowest first: running rings stay compact, so aligned spans
        base = ring  # offset 0 of the ring
        slots = [base] if ring in self._backed_rings else self._slots_of(ring)
        self._backed_rings.add(ring)
        for states in (*self.ssm_states, *self.conv_states):
            for slot in slots:
                states[slot].zero_()
        self._rings[seq_id] = ring
        self._heads[seq_id] = base
        self._head_positions[seq_id] = 0
        return base

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._rings

    def free_sequence(self, seq_id: int) -> None:
        self._check_known(seq_id)
        heapq.heappush(self._free_rings, self._rings.pop(seq_id))
        del self._heads[seq_id]
        del self._head_positions[seq_id]

    def ring_slots(self, seq_id: int) -> list[int]:
        """The R absolute slot indices of the sequence's ring, in order."""
        self._check_known(seq_id)
        return self._slots_of(self._rings[seq_id])

    def _slots_of(self, ring: int) -> list[int]:
        return [ring + k * self.max_seqs for k in range(self.num_ring_slots)]

    def head_offset(self, seq_id: int) -> int:
        """The head's offset in its ring (`ring_slots(seq_id).index(head)`, without the list)."""
        self._check_known(seq_id)
        return (self._heads[seq_id] - self._rings[seq_id]) // self.max_seqs

    def slot_at(self, seq_id: int, offset: int) -> int:
        """The slot at `offset` of the sequence's ring (`ring_slots(seq_id)[offset]`)."""
        self._check_known(seq_id)
        return self._rings[seq_id] + offset * self.max_seqs

    def ring_index(self, seq_id: int) -> int:
        """The ring `seq_id` owns (its slot at ring offset k is ring + k·max_seqs)."""
        self._check_known(seq_id)
        return self._rings[seq_id]

    def move_head(self, seq_id: int, slot: int) -> None:
        """Copy the head's state into `slot` (another slot of the ring) in every
        Mamba layer and make it the head, at the same position."""
        src = self.head(seq_id)
        if slot == src:
            return
        self.set_head(seq_id, slot, self.head_position(seq_id))  # checks the slot is in the ring first
        for states in (*self.ssm_states, *self.conv_states):
            states[slot].copy_(states[src])

    def head(self, seq_id: int) -> int:
        self._check_known(seq_id)
        return self._heads[seq_id]

    def head_position(self, seq_id: int) -> int:
        """Position of the state the head holds: the tokens it has absorbed."""
        self._check_known(seq_id)
        return self._head_positions[seq_id]

    def set_head(self, seq_id: int, slot: int, position: int) -> None:
        """Make `slot` (which must hold the state after `position` tokens) the head."""
        self._check_known(seq_id)
        offset, rest = divmod(slot - self._rings[seq_id], self.max_seqs)  # ring slots: ring + k·max_seqs
        if rest or not 0 <= offset < self.num_ring_slots:
            slots = self.ring_slots(seq_id)
            raise ValueError(
                f"slot {slot} is not in sequence {seq_id}'s ring {slots[0]}..{slots[-1]}; "
                "the head must be one of the sequence's own slots"
            )
        self._heads[seq_id] = slot
        self._head_positions[seq_id] = position

    def read_slot(self, slot: int) -> SlotState:
        """A copy of `slot`'s state in every layer."""
        return SlotState(tuple(s[slot].clone() for s in self.ssm_states),
                         tuple(c[slot].clone() for c in self.conv_states))

    def write_slot(self, slot: int, state: SlotState) -> None:
        """Copy `state` into `slot` of every layer."""
        for states, values in ((self.ssm_states, state.ssm), (self.conv_states, state.conv)):
            for layer, value in zip(states, values):
                layer[slot].copy_(value)

    def snapshot_bookkeeping(self) -> StatePoolBookkeeping:
        return StatePoolBookkeeping(tuple(sorted(self._free_rings)), dict(self._rings), dict(self._heads),
                                    dict(self._head_positions))

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._rings:
            raise KeyError(f"sequence {seq_id} has no state ring; call add_sequence({seq_id}) first")


def head_half(ring: list[int], head: int, count: int) -> str | None:
    """For a round of `count` snapshots under ring halves: "low" when the head
    lies at an offset < count (the round writes offsets count … 2·count-1),
    "high" otherwise (it writes 0 … count-1); None when the ring has fewer than
    2·count slots (no halves) or there is nothing to snapshot."""
    if not count or len(ring) < 2 * count:
        return None
    return "low" if ring.index(head) < count else "high"
