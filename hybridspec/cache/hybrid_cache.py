"""`HybridCache`: every layer's cache of one model for a set of sequences —
the paged KV cache of the attention layers and the state pool (a ring of slots
per sequence, `hybridspec.cache.state_pool`) of the Mamba layers — and
`computed_len` per sequence, the one length both are kept at. `commit` moves
every layer of a sequence to an accepted boundary at once, `rewind_to` back to
an earlier length (a round start); which ring slot holds the state
there is the checkpoints' decision (`Checkpointer`). Every length these take
is a computed length. A forward is a transaction over the cache: planned
(`plan_forward`, `plan_chain`: K/V pages reserved, ring slots chosen), then
committed or aborted; a model runs the maths between and never moves a
length, a page table or a ring head itself.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from typing import TYPE_CHECKING

import torch

from hybridspec.cache.state_pool import SlotState, StatePool, head_half
from hybridspec.kernels import backend as backends
from hybridspec.kernels.slot_plan import SlotPlan
from hybridspec.cache.state_specs import default_state_dtype

from hybridspec.errors import CacheFullError, InvariantError
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.cache.hidden_states import HiddenStates
from hybridspec.cache.paged_kv import KVWriteMeta, PagedKVCache
from hybridspec.cache.tree_batch import TreeBatch

if TYPE_CHECKING:  # the cache sits below the model configuration's users; it reads a config, never builds one
    from hybridspec.config import HybridConfig


@dataclass
class ForwardPlan:
    """Where one forward reads and writes; nothing is committed until `commit_forward`."""

    seq_ids: list[int]
    start_lens: list[int]  # computed_len of each row before the forward
    kv_start_lens: list[int]  # kv_len of each row before the forward (> start_lens: replay over cached K/V)
    num_new: list[int]
    final_slots: list[int]  # slot receiving each row's final state
    batch: ForwardBatch

    def pad_tokens(self, token_lists: list[list[int]], device) -> torch.Tensor:
        """[batch, T] right-padded with 0."""
        T = max(self.num_new)
        rows = [list(t) + [0] * (T - len(t)) for t in token_lists]
        return torch.tensor(rows, dtype=torch.long, device=device)


@dataclass
class ChainPlan:
    """Where a chain of forwards one after another reads and writes (a greedy
    drafter's steps in one native call, `HybridCache.plan_chain`); nothing is
    committed until `commit_chain`."""

    seq_ids: list[int]
    start_lens: list[int]  # computed_len of each row before the chain
    forwards: int
    num_new: int  # new positions per row over the whole chain
    chains: list[list[int]] | None  # row b's ring slots from its head, forwards + 1 (None: no recurrent layer)
    kv: KVWriteMeta | None  # the K/V pages of every new position, reserved at once

    def heads(self) -> list[list[int]]:
        """The ring head after each forward, per row (-1 without recurrent layers)."""
        if self.chains is None:
            return [[-1] * self.forwards for _ in self.seq_ids]
        return [chain[1:] for chain in self.chains]


class HybridCache:
    """dtype: the model's (attention K/V are kept in it); state_dtype: the SSM
    states' and conv windows' (None: `default_state_dtype(dtype)`, float32 below
    float64). spare: the ring slot a forward without a snapshot plan (prefill,
    a plain step) writes its final state to (`spare_slot`): "next", the slot
    after the head, so the ring keeps the states of the last ring_slots − 1
    such forwards (a model drafter's chain of drafts needs them); or "pair",
    the head's partner at ring offset XOR 1, so that plain steps take turns
    between two offsets of a large ring (the Engine's target cache, whose
    plain steps need no history: taking turns between two slots makes its
    steps a little faster than cycling through all of a large ring's)."""

    def __init__(self, config: HybridConfig, *, max_seqs: int, num_blocks: int, block_size: int = 16,
                 ring_slots: int = 2, dtype: torch.dtype = torch.float32, device="cpu",
                 state_dtype: torch.dtype | None = None, spare: str = "next"):
        if spare not in ("next", "pair"):
            raise ValueError(f"spare={spare!r} must be 'next' or 'pair'")
        self.spare = spare
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.backend = backends.select(self.device, dtype)  # the kernels its forwards run, chosen once
        self.block_size, self.ring_slots, self.max_seqs = block_size, ring_slots, max_seqs
        attn = config.attention
        self.kv = (PagedKVCache(len(config.attention_layers), num_blocks, block_size, attn.num_kv_heads,
                                attn.head_dim, dtype, self.device, self.backend) if config.attention_layers else None)
        specs = config.recurrent_state_specs()
        self.state_dtype = state_dtype or default_state_dtype(dtype)
        self.states = StatePool(specs, max_seqs, ring_slots, self.state_dtype, self.device) if specs else None
        self.computed_len: dict[int, int] = {}
        self.graphs = None  # ForwardGraphs (hybridspec.models.graphs) when the forwards over this cache are captured
        self.hidden: HiddenStates | None = None  # a drafter's record of the hidden states its forwards compute

    # -- sequences ----------------------------------------------------------------------------

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.computed_len

    def check_admission(self, num_new_seqs: int) -> None:
        """Raise CacheFullError if `num_new_seqs` more sequences do not fit the
        sequence slots. Allocates nothing; KV pages are the scheduler's to count."""
        free = self.max_seqs - len(self.computed_len)
        if num_new_seqs > free:
            raise CacheFullError(f"{num_new_seqs} new sequences but only {free} of max_seqs={self.max_seqs} "
                                 "sequence slots are free; raise max_seqs or submit a smaller batch")

    def add_sequences(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            if self.has_sequence(s):
                raise ValueError(f"sequence {s} is already in the cache")
        self.check_admission(len(seq_ids))
        for s in seq_ids:
            if self.kv is not None:
                self.kv.add_sequence(s)
            if self.states is not None:
                self.states.add_sequence(s)
            self.computed_len[s] = 0

    def free_sequences(self, seq_ids: list[int]) -> None:
        """Return every page and ring slot of these sequences to their pools."""
        for s in seq_ids:
            if not self.has_sequence(s):
                continue
            if self.kv is not None:
                self.kv.free_sequence(s)
            if self.states is not None:
                self.states.free_sequence(s)
            del self.computed_len[s]
        if self.hidden is not None:
            self.hidden.drop(seq_ids)

    def head(self, seq_id: int) -> int:
        return self.states.head(seq_id) if self.states is not None else -1

    def align_heads(self, seq_ids: list[int], snapshot_counts: list[int] | None = None) -> list[int]:
        """Put the heads of `seq_ids` at one ring offset where they differ, so
        that a forward over them reads and writes spans of the pool (states
        computed in place; `kernels/slot_plan.py`). A head that moves has its
        state copied (`StatePool.move_head`): same state, same position.
        Returns every row's head afterwards.

        - A plain step (`snapshot_counts` None): every head to the offset most
          of them are at. Outside a round no ring slot but the head holds
          anything needed. Nothing moves where the Triton kernels run: they
          take any slots.
        - A round under ring halves (`snapshot_counts[b]`: row b's snapshots,
          `head_half`): only a head in the other half than most rows' moves,
          to the majority's most common head offset, so that the round writes
          the same offsets in every row. The round never writes a head
          (`plan_snapshots`), so the copy is safe whatever each row's count."""
        heads = [self.head(s) for s in seq_ids]
        if self.states is None or len(seq_ids) < 2:
            return heads
        if snapshot_counts is None and self.backend.writes_any_slot:
            return heads
        offsets = [self.states.head_offset(s) for s in seq_ids]
        if snapshot_counts is None:  # each offset is its own group
            groups, candidates = offsets, set(offsets)
        else:
            groups = [head_half(self.states.ring_slots(s), head, count)
                      for s, head, count in zip(seq_ids, heads, snapshot_counts)]
            candidates = ("low", "high")
        known = [g for g in groups if g is not None]
        if len(set(known)) < 2:
            return heads
        majority = max(candidates, key=known.count)
        chosen = [at for at, group in zip(offsets, groups) if group == majority]
        offset = max(set(chosen), key=chosen.count)  # the majority's most common head offset: sources in one span
        for b, (s, group) in enumerate(zip(seq_ids, groups)):
            if group is not None and group != majority:
                heads[b] = self.states.slot_at(s, offset)
                self.states.move_head(s, heads[b])
        return heads

    def spare_slot(self, seq_id: int) -> int:
        """The ring slot a forward without a snapshot plan writes (`spare`): the
        one after the head, or the head's partner at offset XOR 1 (the slot
        after it for the last offset of an odd ring); the head itself with a
        one-slot ring."""
        if self.states is None:
            return -1
        at, size = self.states.head_offset(seq_id), self.states.num_ring_slots
        if self.spare == "pair" and (at ^ 1) < size:
            return self.states.slot_at(seq_id, at ^ 1)
        return self.states.slot_at(seq_id, (at + 1) % size)

    # -- one forward --------------------------------------------------------------------------

    def plan_forward(self, seq_ids: list[int], num_new: list[int],
                     snap_slot: torch.Tensor | list[list[int]] | None, tree: TreeBatch | None = None) -> ForwardPlan:
        """Reserve KV pages for the new positions (all-or-nothing) and build the
        ForwardBatch. With `snap_slot=None` the final state goes to a spare slot.
        With `tree` the inputs form that tree (its forward writes the snapshots `snap_slot` names)."""
        if any(n < 1 for n in num_new):
            raise ValueError(f"every row needs at least one new token, got {num_new}")
        start = [self.computed_len[s] for s in seq_ids]
        T = max(num_new)
        final_state_only = snap_slot is None
        if final_state_only:
            final = [self.spare_slot(s) for s in seq_ids]
            snap = [[slot if t == n - 1 else -1 for t in range(T)] for slot, n in zip(final, num_new)]
        else:
            final = [-1] * len(seq_ids)
            snap = snap_slot.tolist() if isinstance(snap_slot, torch.Tensor) else [list(r) for r in snap_slot]
        slots = SlotPlan.of_lists([self.head(s) for s in seq_ids], snap, num_new, self.device)
        kv_meta = self.kv.prepare_write(seq_ids, num_new, start) if self.kv is not None else None
        kv_start = [self.kv.kv_len(s) for s in seq_ids] if self.kv is not None else list(start)
        batch = ForwardBatch(slots=slots, start_lens=start, kv=kv_meta, final_state_only=final_state_only,
                             hidden=None if self.hidden is None else self.hidden.capture(), tree=tree)
        if tree is not None:
            tree.slots = slots
        return ForwardPlan(seq_ids, start, kv_start, list(num_new), final, batch)

    def abort_forward(self, plan: ForwardPlan) -> None:
        """Undo `plan_forward`: free pages reserved past each row's old KV length."""
        if self.kv is not None:
            for s, n in zip(plan.seq_ids, plan.kv_start_lens):
                self.kv.truncate(s, n)
        if self.hidden is not None:
            for s, start in zip(plan.seq_ids, plan.start_lens):
                self.hidden.rewind(s, start)

    def record_hidden(self, plan: ForwardPlan) -> None:
        """Hand the hidden states `plan`'s forward captured to `hidden`, pending
        until a commit keeps the accepted ones (`HiddenStates`)."""
        if self.hidden is not None and plan.batch.hidden is not None and plan.batch.hidden.values is not None:
            self.hidden.put(plan.seq_ids, plan.start_lens, plan.num_new, plan.batch.hidden.values)

    def commit_forward(self, plan: ForwardPlan) -> None:
        """Advance every row by all its new tokens (plain prefill/extend/decode). A row
        replaying over cached K/V (`restore_prefix`) keeps its KV length until it passes it."""
        for s, start, n, slot, kv_start in zip(plan.seq_ids, plan.start_lens, plan.num_new, plan.final_slots,
                                               plan.kv_start_lens):
            if start + n < kv_start:
                if self.states is not None:
                    self.states.set_head(s, slot, start + n)
                self.computed_len[s] = start + n
                if self.hidden is not None:
                    self.hidden.commit(s, start + n)
            else:
                self.commit(s, start + n, slot)

    def plan_chain(self, seq_ids: list[int], forwards: int, num_new: int) -> ChainPlan | None:
        """Plan `forwards` forwards one after another over `num_new` new positions
        per row: row b's state passes along its ring from the head (`chains[b]`,
        forwards + 1 slots; the head is never written), the K/V of every position
        reserved at once (all-or-nothing). None, with nothing changed, where a ring
        is too short for the chain (it would come back to the head) or a row
        replays over cached K/V (a prefix-cache hit: plain forwards take it)."""
        starts = [self.computed_len[s] for s in seq_ids]
        if self.kv is not None and any(self.kv.kv_len(s) != n for s, n in zip(seq_ids, starts)):
            return None
        chains = None
        if self.states is not None:
            chains = []
            for s in seq_ids:
                ring = self.states.ring_slots(s)
                if len(ring) < forwards + 1:
                    return None
                at = ring.index(self.head(s))
                chains.append([ring[(at + k) % len(ring)] for k in range(forwards + 1)])
        meta = self.kv.prepare_write(seq_ids, [num_new] * len(seq_ids), starts) if self.kv is not None else None
        return ChainPlan(list(seq_ids), starts, forwards, num_new, chains, meta)

    def abort_chain(self, plan: ChainPlan) -> None:
        """Undo `plan_chain`: free the pages it reserved."""
        if self.kv is not None:
            for s, n in zip(plan.seq_ids, plan.start_lens):
                self.kv.truncate(s, n)

    def commit_chain(self, plan: ChainPlan) -> list[list[int]]:
        """Commit every row of the chain at its last position, the head at the last
        forward's slot. Returns the ring head after each forward, per row."""
        heads = plan.heads()
        for s, start, row in zip(plan.seq_ids, plan.start_lens, heads):
            self.commit(s, start + plan.num_new, row[-1])
        return heads

    def restore_prefix(self, seq_id: int, pages: list[int], num_cached: int, state_position: int,
                       state: SlotState | None) -> None:
        """Start an empty sequence from a prefix-cache hit: `pages` hold the K/V of positions
        [0, num_cached) (shared, one more holder each), `state` (None: the zero state) the
        recurrent state after `state_position` <= num_cached tokens, copied into the head.
        computed_len becomes `state_position`: the next forwards replay the tail over the
        cached K/V up to num_cached, then continue as usual."""
        if self.computed_len.get(seq_id) != 0:
            raise ValueError(f"sequence {seq_id} must be freshly added (computed_len 0) to restore a prefix")
        if not 0 <= state_position <= num_cached:
            raise ValueError(f"state position {state_position} must lie in [0, num_cached={num_cached}]")
        if self.kv is not None:
            self.kv.share_prefix(seq_id, pages, num_cached)
        if self.states is not None:
            head = self.states.head(seq_id)
            if state is not None:
                self.states.write_slot(head, state)
            self.states.set_head(seq_id, head, state_position)
        self.computed_len[seq_id] = state_position

    def commit(self, seq_id: int, boundary: int, head_slot: int) -> None:
        """Move every layer of `seq_id` to the accepted `boundary` (a computed
        length, at most what the last forward absorbed): the KV length (pages
        wholly past it freed) and the ring head, which must hold the state there."""
        self._move_to(seq_id, boundary, head_slot)
        if self.hidden is not None:
            self.hidden.commit(seq_id, boundary)

    def rewind_to(self, seq_id: int, computed_len: int, head_slot: int) -> None:
        """Move every layer of `seq_id` back to an earlier `computed_len` whose
        state `head_slot` still holds (a round start, which nothing in the round
        wrote): the KV length (pages wholly past it freed) and the ring head."""
        if computed_len > self.computed_len[seq_id]:
            raise ValueError(f"rewind_to(seq {seq_id}, computed_len={computed_len}) is past its computed length "
                             f"{self.computed_len[seq_id]}; a forward's `commit` moves a sequence forward")
        self._move_to(seq_id, computed_len, head_slot)
        if self.hidden is not None:
            self.hidden.rewind(seq_id, computed_len)

    def _move_to(self, seq_id: int, computed_len: int, head_slot: int) -> None:
        if self.kv is not None:
            if computed_len <= self.kv.kv_len(seq_id):
                self.kv.truncate(seq_id, computed_len)
            else:
                self.kv.commit(seq_id, computed_len)
        if self.states is not None:
            self.states.set_head(seq_id, head_slot, computed_len)
        self.computed_len[seq_id] = computed_len

    def check_invariant(self, seq_id: int, boundary: int) -> None:
        """Every layer of `seq_id` at `boundary` (a computed length: committed_len − 1
        outside a round): kv_len == state position == computed_len == boundary."""
        computed = self.computed_len[seq_id]
        kv_len = self.kv.kv_len(seq_id) if self.kv is not None else computed
        state_pos = self.states.head_position(seq_id) if self.states is not None else computed
        if not kv_len == state_pos == computed == boundary:
            raise InvariantError(f"sequence {seq_id}: kv_len={kv_len}, state position={state_pos}, "
                                 f"computed_len={computed}, expected all equal to the boundary {boundary} "
                                 "(committed_len - 1)")

    def bookkeeping(self) -> dict:
        """A comparable export of every index (for 'nothing changed' assertions).
        Free lists are compared as sets: their order is an allocation detail."""
        kv = states = None
        if self.kv is not None:
            kv = self.kv.snapshot_bookkeeping()
            kv = replace(kv, pool=replace(kv.pool, free_blocks=tuple(sorted(kv.pool.free_blocks))))
        if self.states is not None:
            states = self.states.snapshot_bookkeeping()
            states = replace(states, free_rings=tuple(sorted(states.free_rings)))
        return {"computed_len": dict(self.computed_len), "kv": kv, "states": states}


def scratch_cache(model, max_seqs: int, ring_slots: int, state_dtype: torch.dtype | None = None,
                  max_len: int = 64, block_size: int = 16) -> HybridCache:
    """A small cache of `model` for measurements: `max_seqs` sequences of up to `max_len` tokens."""
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=max_seqs * -(-max_len // block_size),
                       block_size=block_size, ring_slots=ring_slots, dtype=model.dtype, device=model.device,
                       state_dtype=state_dtype)
