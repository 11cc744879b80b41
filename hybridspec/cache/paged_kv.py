"""Paged attention KV cache: page storage for every attention layer, one block
table and one `kv_len` per sequence.

Terms
  page, block   `block_size` consecutive token slots; position p of a sequence
                lives in page `block_table[p // block_size]` at offset `p % block_size`
  kv_len        positions 0 .. kv_len - 1 hold valid K/V (the runtime's `computed_len`)
  reserved_len  positions the last `prepare_write` made room for; `commit` may move
                kv_len up to it once the forward has written them. The block table
                always holds exactly the pages covering [0, reserved_len).
  shared page   a page with reference count > 1 (after `fork`, `share_prefix`, or held by
                the prefix cache); the first write to it copies it (copy-on-write), so no
                sequence sees another's writes
  cached K/V    a forward may start before kv_len (`prepare_write(..., starts=)`: a prefix-cache
                replay of the recurrent layers): positions [start, kv_len) already hold valid
                K/V, so they are read, never written

One block table serves every attention layer: `k_cache[layer]` and
`v_cache[layer]` are `[num_blocks, block_size, num_kv_heads, head_dim]` views
of one `[num_layers, ...]` tensor each. New pages go right after a sequence's
last page where they are free (`BlockPool.allocate`), so its block table is
usually one run of consecutive pages, which attention on CPU reads as a view.

Flow of one forward:
  meta = cache.prepare_write(seq_ids, num_new)     # admission, pages, copy-on-write
  for layer: cache.write(layer, meta, k, v); attend with meta
  cache.commit(seq_id, new_len)                    # per sequence, after success
A forward that raises leaves every kv_len as it was.
"""

from collections import Counter
from dataclasses import dataclass

import functools

import torch

from hybridspec.errors import CacheFullError
from hybridspec.kernels import backend as backends
from hybridspec.kernels.reference import gather_pages

from hybridspec.cache.block_pool import BlockPool, BlockPoolState, consecutive_runs
from hybridspec.cache.state_specs import AttentionKVSpec


class KVWriteMeta:
    """Where one forward writes its new tokens and what its attention reads.
    Kept as host lists; the tensors (for the Triton kernel and the gathers)
    are made on first use, once per forward."""

    def __init__(self, seq_ids, slot_rows: list[list[int]], table_rows: list[list[int]], context_lens: list[int],
                 num_new: list[int], device):
        self.seq_ids: tuple[int, ...] = tuple(seq_ids)
        self.slot_rows, self.table_rows, self.device = slot_rows, table_rows, device
        self.context_list: tuple[int, ...] = tuple(context_lens)  # kv_len + num_new per row
        self.query_list: tuple[int, ...] = tuple(num_new)
        self.t_max = max(num_new, default=0)

    @functools.cached_property
    def page_runs(self) -> tuple[tuple[tuple[int, int], ...], ...]:  # per row: block table as (first_page, num_pages) runs
        return tuple(tuple(consecutive_runs(r)) for r in self.table_rows)

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @functools.cached_property
    def slot_mapping(self) -> torch.Tensor:  # [batch, T_max] int64: page * block_size + offset, -1 for padding
        return self.packed[0]

    @functools.cached_property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot_mapping, context_lens, query_lens, block tables [batch, max_blocks] int64)
        as views of one tensor: one host-to-device copy for the forward's CPU blocks."""
        batch = len(self.seq_ids)
        width = max(1, max((len(r) for r in self.table_rows), default=0))
        values = [slot for row in self.slot_rows for slot in row] + list(self.context_list) + list(self.query_list)
        values += [page for r in self.table_rows for page in r + [-1] * (width - len(r))]
        flat = self._tensor(values)
        slots, context, query, tables = flat.split([batch * self.t_max, batch, batch, batch * width])
        return slots.view(batch, self.t_max), context, query, tables.view(batch, width)

    @property
    def block_tables(self) -> torch.Tensor:  # [batch, max_blocks] int64: pages covering context_lens, -1 padded
        return self.packed[3]

    @functools.cached_property
    def context_lens(self) -> torch.Tensor:  # [batch] int64: the keys attention sees after the write
        return self.packed[1]

    @functools.cached_property
    def query_lens(self) -> torch.Tensor:  # [batch] int64: num_new
        return self.packed[2]

    @functools.cached_property
    def _live(self) -> list[tuple[int, int]]:
        return [(b * self.t_max + t, slot) for b, row in enumerate(self.slot_rows) for t, slot in enumerate(row)
                if slot >= 0]

    @functools.cached_property
    def write_index(self) -> torch.Tensor:  # [live tokens] slot of every new token, row by row
        return self._tensor([slot for _, slot in self._live])

    @functools.cached_property
    def write_rows(self) -> torch.Tensor | None:  # [live tokens] index in the flattened [batch · T_max]; None: all
        if len(self._live) == len(self.seq_ids) * self.t_max:
            return None
        return self._tensor([i for i, _ in self._live])


@dataclass(frozen=True)
class KVCacheBookkeeping:
    """A copy of every index the cache keeps, comparable with `==` ("the cache is unchanged")."""

    block_tables: dict[int, tuple[int, ...]]
    kv_lens: dict[int, int]
    reserved_lens: dict[int, int]
    pool: BlockPoolState


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: backends.Backend | None = None,
    ):
        for name, value in (("num_layers", num_layers), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.pool = BlockPool(num_blocks)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._flat_views: dict[int, list[torch.Tensor]] = {}  # id(k_cache | v_cache) -> per-layer flat views
        # the K/V write of the backend chosen for this device and dtype (once, here)
        self._write = (backend or backends.select(device, dtype)).kv_write
        self._block_tables: dict[int, list[int]] = {}
        self._kv_lens: dict[int, int] = {}
        self._reserved_lens: dict[int, int] = {}

    # ---- sequences -------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._block_tables:
            raise ValueError(f"sequence {seq_id} is already in the KV cache; free it first or use a new id")
        self._block_tables[seq_id] = []
        self._kv_lens[seq_id] = 0
        self._reserved_lens[seq_id] = 0

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._block_tables

    def free_sequence(self, seq_id: int) -> None:
        """Drop the sequence; each of its pages loses one holder."""
        self._check_known(seq_id)
        self.pool.free(self._block_tables.pop(seq_id))
        del self._kv_lens[seq_id]
        del self._reserved_lens[seq_id]

    def fork(self, src_seq_id: int, dst_seq_id: int) -> None:
        """`dst` shares `src`'s pages up to its kv_len; the first write to a shared page copies it."""
        self._check_known(src_seq_id)
        if dst_seq_id in self._block_tables:
            raise ValueError(f"fork target {dst_seq_id} already exists; free it first or use a new id")
        kv_len = self._kv_lens[src_seq_id]
        shared = self._block_tables[src_seq_id][: _cdiv(kv_len, self.block_size)]
        for block in shared:
            self.pool.incref(block)
        self._block_tables[dst_seq_id] = list(shared)
        self._kv_lens[dst_seq_id] = kv_len
        self._reserved_lens[dst_seq_id] = kv_len

    def share_prefix(self, seq_id: int, pages: list[int], kv_len: int) -> None:
        """An empty sequence takes `pages` (one more holder each) as the pages of positions
        [0, kv_len): a prefix-cache hit. Its first write into a shared page copies it."""
        self._check_known(seq_id)
        if self._block_tables[seq_id]:
            raise ValueError(f"sequence {seq_id} already holds pages; share a prefix only into an empty sequence")
        if len(pages) != _cdiv(kv_len, self.block_size):
            raise ValueError(f"{len(pages)} pages cannot hold exactly kv_len={kv_len} positions of "
                             f"{self.block_size} per page")
        for block in pages:
            self.pool.incref(block)
        self._block_tables[seq_id] = list(pages)
        self._kv_lens[seq_id] = kv_len
        self._reserved_lens[seq_id] = kv_len

    def pages_written_next(self) -> set[int]:
        """Pages holding some sequence's position kv_len (a partial last page): its next
        forward writes there, copying the page first if it is shared."""
        bs = self.block_size
        return {self._block_tables[s][n // bs] for s, n in self._kv_lens.items() if n % bs}

    def kv_len(self, seq_id: int) -> int:
        self._check_known(seq_id)
        return self._kv_lens[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        self._check_known(seq_id)
        return list(self._block_tables[seq_id])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one page over every layer."""
        per_token = AttentionKVSpec(self.num_kv_heads, self.head_dim).bytes_per_token(self.k_cache.element_size())
        return self.num_layers * self.block_size * per_token

    # ---- admission -------------------------------------------------------

    def blocks_needed(self, seq_id: int, new_len: int) -> int:
        """Pages `seq_id` must take from the pool to hold valid K/V up to `new_len`:
        `_count_blocks_needed` for one sequence (the only writer of its pages, so
        each shared page it writes costs one copy), without its counters (the
        scheduler asks this for every row of every round)."""
        self._check_known(seq_id)
        if new_len < self._kv_lens[seq_id]:
            return self._count_blocks_needed({seq_id: new_len})[0]  # raises, naming the lengths
        return self.blocks_needed_each([(seq_id, new_len)])

    def blocks_needed_each(self, lengths: list[tuple[int, int]]) -> int:
        """Σ `blocks_needed(seq_id, max(new_len, kv_len))` over `(seq_id, new_len)`
        pairs, each sequence counted alone (what the scheduler reserves for a
        round), in one pass over the tables."""
        bs, tables, kv_lens, refs = self.block_size, self._block_tables, self._kv_lens, self.pool.ref_counts_view()
        total = 0
        for seq_id, new_len in lengths:
            self._check_known(seq_id)
            kv_len, table = kv_lens[seq_id], tables[seq_id]
            if new_len <= kv_len:
                continue
            end = -(-new_len // bs)
            total += max(0, end - len(table))
            for block in table[kv_len // bs:end]:
                total += refs[block] > 1
        return total

    def check_admission(self, requests: dict[int, int]) -> None:
        """Raise CacheFullError unless every `seq_id -> new_len` fits at once; changes nothing."""
        needed, num_new, num_copies = self._count_blocks_needed(requests)
        if needed > self.pool.num_free:
            raise CacheFullError(
                f"the batch needs {needed} free KV pages ({num_new} new, {num_copies} copy-on-write) "
                f"but only {self.pool.num_free} of {self.pool.num_blocks} are free; "
                "raise num_blocks or run a smaller batch"
            )

    def _count_blocks_needed(self, requests: dict[int, int]) -> tuple[int, int, int]:
        """(total, new pages, copy-on-write copies) for the requests taken in order."""
        num_new = 0
        writers: Counter[int] = Counter()  # shared page -> sequences of the batch writing it
        for seq_id, new_len in requests.items():
            self._check_known(seq_id)
            if new_len < self._kv_lens[seq_id]:
                raise ValueError(
                    f"new_len={new_len} < kv_len={self._kv_lens[seq_id]} of sequence {seq_id}; "
                    "use truncate() to shorten a sequence"
                )
            num_new += max(0, _cdiv(new_len, self.block_size) - len(self._block_tables[seq_id]))
            writers.update(b for b in self._pages_written(seq_id, new_len) if self.pool.ref_count(b) > 1)
        # With w of a page's rc holders writing it, each copies it until the last holder
        # finds itself alone (rc == 1) and writes in place.
        num_copies = sum(
            w if w < self.pool.ref_count(b) else self.pool.ref_count(b) - 1 for b, w in writers.items()
        )
        return num_new + num_copies, num_new, num_copies

    def _pages_written(self, seq_id: int, new_len: int) -> list[int]:
        """Existing pages of `seq_id` that writing positions [kv_len, new_len) touches."""
        kv_len = self._kv_lens[seq_id]
        if new_len <= kv_len:
            return []
        first, end = kv_len // self.block_size, _cdiv(new_len, self.block_size)
        return self._block_tables[seq_id][first:end]

    # ---- one forward -----------------------------------------------------

    def prepare_write(self, seq_ids: list[int], num_new: list[int], starts: list[int] | None = None) -> KVWriteMeta:
        """Make room for positions [start, start + num_new) of each sequence; all or nothing.
        `starts` default to each kv_len; a start below kv_len (never above) means positions
        [start, kv_len) already hold valid K/V: the forward reads them and writes only from kv_len.

        Does not move kv_len: call `commit` after the forward has written the K/V.
        """
        if len(seq_ids) != len(num_new):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(num_new)} num_new entries; pass one per sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {seq_ids} repeat a sequence; list each sequence once")
        if any(n < 0 for n in num_new):
            raise ValueError(f"num_new {num_new} has a negative count")
        starts = [self.kv_len(s) for s in seq_ids] if starts is None else list(starts)
        bad = [(s, start) for s, start in zip(seq_ids, starts) if not 0 <= start <= self.kv_len(s)]
        if bad:
            s, start = bad[0]
            raise ValueError(f"start={start} of sequence {s} lies outside [0, kv_len={self.kv_len(s)}]; a forward "
                             "starts at or before kv_len (before it: over cached K/V)")
        requests = {s: max(self.kv_len(s), start + n) for s, start, n in zip(seq_ids, starts, num_new)}
        self.check_admission(requests)
        for seq_id, new_len in requests.items():
            self._make_writable(seq_id, new_len)
            self._reserved_lens[seq_id] = new_len
        return self._write_meta(seq_ids, num_new, starts)

    def _make_writable(self, seq_id: int, new_len: int) -> None:
        table = self._block_tables[seq_id]
        first = self._kv_lens[seq_id] // self.block_size
        for index, block in enumerate(self._pages_written(seq_id, new_len), start=first):
            if self.pool.ref_count(block) > 1:
                table[index] = self._copy_page(block, after=table[index - 1] if index else None)
        num_pages = _cdiv(new_len, self.block_size)
        self.pool.free(table[num_pages:])  # pages an earlier, abandoned prepare_write reserved
        del table[num_pages:]
        table.extend(self.pool.allocate(num_pages - len(table), after=table[-1] if table else None))

    def _copy_page(self, block: int, after: int | None) -> int:
        """Copy-on-write: a private copy of a shared page in every layer, placed after page `after`
        where it is free; the original loses a holder."""
        (copy,) = self.pool.allocate(1, after=after)
        self.k_cache[:, copy] = self.k_cache[:, block]
        self.v_cache[:, copy] = self.v_cache[:, block]
        self.pool.decref(block)
        return copy

    def _write_meta(self, seq_ids: list[int], num_new: list[int], starts: list[int]) -> KVWriteMeta:
        bs = self.block_size
        t_max = max(num_new, default=0)
        slot_rows, table_rows, context_lens = [], [], []
        for seq_id, n, start in zip(seq_ids, num_new, starts):
            table, kv_len = self._block_tables[seq_id], self._kv_lens[seq_id]
            # -1: cached K/V (p < kv_len) read in place, or padding
            slots = [table[p // bs] * bs + p % bs if p >= kv_len else -1 for p in range(start, start + n)]
            slot_rows.append(slots + [-1] * (t_max - n))
            table_rows.append(table[: _cdiv(start + n, bs)])
            context_lens.append(start + n)
        return KVWriteMeta(seq_ids, slot_rows, table_rows, context_lens, num_new, self.k_cache.device)

    def write(self, layer: int, meta: KVWriteMeta, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the new tokens' K/V `[batch, T_max, num_kv_heads, head_dim]` into `layer`'s pages."""
        expected = (len(meta.seq_ids), meta.t_max, self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {expected} [batch, T_max, heads, dim]")
            if x.dtype != self.k_cache.dtype:
                raise ValueError(f"{name} has dtype {x.dtype}; the cache holds {self.k_cache.dtype}")
        self._write(self._flat_layers(self.k_cache)[layer], self._flat_layers(self.v_cache)[layer], meta, k, v)

    def _flat_layers(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, `cache[layer]` as [num_blocks * block_size, heads, dim] views, made once."""
        views = self._flat_views.get(id(cache))
        if views is None:
            views = self._flat_views[id(cache)] = [cache[i].view(-1, self.num_kv_heads, self.head_dim)
                                                   for i in range(cache.shape[0])]
        return views

    def gather(self, layer: int, meta: KVWriteMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[batch, max(context_lens), num_kv_heads, head_dim]`, zeros past each row's context."""
        k = gather_pages(self.k_cache[layer], meta.block_tables, meta.context_lens)
        v = gather_pages(self.v_cache[layer], meta.block_tables, meta.context_lens)
        return k, v

    def move_positions(self, seq_id: int, sources: list[int], targets: list[int]) -> None:
        """Every layer's K/V at positions `sources` of `seq_id` copied to `targets` (a tree
        round's accepted inputs onto the sequence's next positions), all read before any
        is written; positions within what the last `prepare_write` reserved."""
        if not sources:
            return
        table = self._block_tables[seq_id]
        bs = self.block_size

        def slots(positions):
            return torch.tensor([table[p // bs] * bs + p % bs for p in positions], device=self.k_cache.device)

        src, dst = slots(sources), slots(targets)
        for cache in (self.k_cache, self.v_cache):
            for flat in self._flat_layers(cache):
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def commit(self, seq_id: int, new_len: int) -> None:
        """After the forward: positions < new_len are valid; free the pages wholly past it."""
        self._check_known(seq_id)
        kv_len, reserved = self._kv_lens[seq_id], self._reserved_lens[seq_id]
        if not kv_len <= new_len <= reserved:
            raise ValueError(
                f"commit(seq {seq_id}, new_len={new_len}): must lie in [kv_len={kv_len}, {reserved}], "
                "the range the last prepare_write made room for; use truncate() to shorten"
            )
        self._set_len(seq_id, new_len)

    def truncate(self, seq_id: int, new_len: int) -> None:
        """Roll back to `new_len` <= kv_len; free every page wholly past it."""
        self._check_known(seq_id)
        if not 0 <= new_len <= self._kv_lens[seq_id]:
            raise ValueError(
                f"truncate(seq {seq_id}, new_len={new_len}): must lie in [0, kv_len={self._kv_lens[seq_id]}]"
            )
        self._set_len(seq_id, new_len)

    def _set_len(self, seq_id: int, new_len: int) -> None:
        table = self._block_tables[seq_id]
        keep = _cdiv(new_len, self.block_size)
        self.pool.free(table[keep:])
        del table[keep:]
        self._kv_lens[seq_id] = new_len
        self._reserved_lens[seq_id] = new_len

    # ---- checks ----------------------------------------------------------

    def snapshot_bookkeeping(self) -> KVCacheBookkeeping:
        return KVCacheBookkeeping(
            block_tables={s: tuple(t) for s, t in self._block_tables.items()},
            kv_lens=dict(self._kv_lens),
            reserved_lens=dict(self._reserved_lens),
            pool=self.pool.snapshot(),
        )

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._block_tables:
            raise KeyError(f"sequence {seq_id} is not in the KV cache; call add_sequence({seq_id}) first")
