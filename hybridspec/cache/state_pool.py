"""State pool: recurrent-state storage of every Mamba layer, a ring of slots per sequence.

Terms
  slot   one copy of a layer's state: SSM state plus conv window
  ring   the `ring_slots` consecutive slots a sequence owns, the same slot
         indices in every Mamba layer: ring r holds slots r*R .. r*R + R - 1
  head   the slot holding the state at the sequence's boundary; the model
         reads and advances it, the checkpoint policy writes snapshots into the
         other slots of the ring and moves the head on restore (no copy)

Storage per Mamba layer, slot-major and contiguous:
  ssm_states[layer]   [max_seqs * R, *ssm_shape]   (nheads, headdim, d_state) Mamba2 | (d_inner, d_state) Mamba1
  conv_states[layer]  [max_seqs * R, *conv_shape]  (conv_dim, d_conv - 1)
This module keeps only which ring a sequence owns and where its head is;
snapshot positions and replay belong to the checkpoint policy.
"""

from collections import deque
from dataclasses import dataclass
from math import prod
from typing import NamedTuple, Sequence

import torch

from hybridspec.errors import CacheFullError


class MambaStateShape(NamedTuple):
    """Per-slot state shapes of one Mamba layer; a plain `(ssm, conv)` pair works too."""

    ssm: tuple[int, ...]  # (nheads, headdim, d_state) Mamba2 | (d_inner, d_state) Mamba1
    conv: tuple[int, ...]  # (conv_dim, d_conv - 1)


def _as_state_shape(spec: Sequence[Sequence[int]]) -> MambaStateShape:
    ssm, conv = spec
    shape = MambaStateShape(tuple(ssm), tuple(conv))
    for name, dims in shape._asdict().items():
        if not dims or any(d < 1 for d in dims):
            raise ValueError(f"{name} state shape {dims}: every dimension must be >= 1")
    return shape


@dataclass(frozen=True)
class StatePoolBookkeeping:
    """A copy of the pool's indices, comparable with `==` ("the pool is unchanged")."""

    free_rings: tuple[int, ...]  # in allocation order
    rings: dict[int, int]  # seq_id -> ring index
    heads: dict[int, int]  # seq_id -> absolute head slot


class StatePool:
    def __init__(
        self,
        layer_shapes: Sequence[MambaStateShape | tuple[tuple[int, ...], tuple[int, ...]]],
        max_seqs: int,
        ring_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_seqs < 1:
            raise ValueError(f"max_seqs={max_seqs}: the state pool needs room for at least one sequence")
        if ring_slots < 1:
            raise ValueError(f"ring_slots={ring_slots}: a ring needs at least one slot (the head)")
        self.layer_shapes = tuple(_as_state_shape(spec) for spec in layer_shapes)
        self.max_seqs = max_seqs
        self.num_ring_slots = ring_slots
        self.dtype = dtype
        num_slots = max_seqs * ring_slots
        self.ssm_states = [torch.zeros(num_slots, *s.ssm, dtype=dtype, device=device) for s in self.layer_shapes]
        self.conv_states = [torch.zeros(num_slots, *s.conv, dtype=dtype, device=device) for s in self.layer_shapes]
        self._free_rings: deque[int] = deque(range(max_seqs))
        self._rings: dict[int, int] = {}
        self._heads: dict[int, int] = {}

    @property
    def num_free_rings(self) -> int:
        return len(self._free_rings)

    @property
    def bytes_per_slot(self) -> int:
        """SSM state plus conv window of one slot, over every Mamba layer."""
        return self.dtype.itemsize * sum(prod(s.ssm) + prod(s.conv) for s in self.layer_shapes)

    def check_admission(self, num_new_seqs: int) -> None:
        if num_new_seqs > len(self._free_rings):
            raise CacheFullError(
                f"{num_new_seqs} new sequences need a state ring each but only {len(self._free_rings)} "
                f"of {self.max_seqs} rings are free; raise max_seqs or run a smaller batch"
            )

    def add_sequence(self, seq_id: int) -> int:
        """Give `seq_id` a zeroed ring; returns its base slot, which is also the head."""
        if seq_id in self._rings:
            raise ValueError(f"sequence {seq_id} already owns a state ring; free it first or use a new id")
        self.check_admission(1)
        ring = self._free_rings.popleft()
        base = ring * self.num_ring_slots
        for states in (*self.ssm_states, *self.conv_states):
            states[base : base + self.num_ring_slots].zero_()
        self._rings[seq_id] = ring
        self._heads[seq_id] = base
        return base

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._rings

    def free_sequence(self, seq_id: int) -> None:
        self._check_known(seq_id)
        self._free_rings.append(self._rings.pop(seq_id))
        del self._heads[seq_id]

    def ring_slots(self, seq_id: int) -> list[int]:
        """The R absolute slot indices of the sequence's ring, in order."""
        self._check_known(seq_id)
        base = self._rings[seq_id] * self.num_ring_slots
        return list(range(base, base + self.num_ring_slots))

    def head(self, seq_id: int) -> int:
        self._check_known(seq_id)
        return self._heads[seq_id]

    def set_head(self, seq_id: int, slot: int) -> None:
        slots = self.ring_slots(seq_id)
        if slot not in slots:
            raise ValueError(
                f"slot {slot} is not in sequence {seq_id}'s ring {slots[0]}..{slots[-1]}; "
                "the head must be one of the sequence's own slots"
            )
        self._heads[seq_id] = slot

    def snapshot_bookkeeping(self) -> StatePoolBookkeeping:
        return StatePoolBookkeeping(tuple(self._free_rings), dict(self._rings), dict(self._heads))

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._rings:
            raise KeyError(f"sequence {seq_id} has no state ring; call add_sequence({seq_id}) first")
