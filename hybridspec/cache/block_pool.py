"""Block pool: the free pages and reference counts of the KV pages.

A page (block) holds the K/V entries of `block_size` consecutive tokens of one
sequence in every attention layer. A page may be listed in several block
tables at once (after a fork); its reference count is the number of tables
that hold it, and it returns to the free pages when that count drops to 0.
This module is bookkeeping only: page ids and counts, no tensors.

Placement: attention on CPU reads a sequence whose pages are consecutive ids
as one view of the page storage, with no copy, so `allocate` keeps a
sequence's pages consecutive where it can. It takes the pages right after the
sequence's last page when they are free; otherwise it starts a new run of
pages in the largest stretch of free pages, in the middle of that stretch's
spare room so that the run before it and the new one can both grow (at page 0
when the stretch starts there, since no run lies before it).
"""

from dataclasses import dataclass

from hybridspec.errors import CacheFullError


def consecutive_runs(pages: list[int]) -> list[tuple[int, int]]:
    """`pages` cut into runs of consecutive ids, as `(first_page, num_pages)` in list order:
    [4, 5, 6, 9, 10] -> [(4, 3), (9, 2)]."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


@dataclass(frozen=True)
class BlockPoolState:
    """An immutable copy of the pool's bookkeeping, comparable with `==`."""

    free_blocks: tuple[int, ...]  # sorted
    ref_counts: tuple[int, ...]  # [num_blocks]


class BlockPool:
    """Free pages plus reference counts over pages `0 .. num_blocks - 1`."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: a block pool needs at least one page")
        self.num_blocks = num_blocks
        # the free pages as a map (1: free), read in C-speed scans: free runs are found
        # with `find` (walking a sorted set in Python costs far more per new run of a large pool)
        self._free_map = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take `n` free pages, each with reference count 1; all or nothing.
        `after` is the last page of the sequence they extend (None for its first pages)."""
        if n < 0:
            raise ValueError(f"allocate(n={n}): n must be >= 0")
        if after is not None:
            self._check_id(after)
        if not self.can_allocate(n):
            raise CacheFullError(
                f"need {n} free KV pages but only {self._num_free} of {self.num_blocks} are free; "
                "raise num_blocks or run a smaller batch"
            )
        if n == 0:  # most forwards: the last page has room (no placement search over the free pages)
            return []
        follows = after is not None and after + n < self.num_blocks \
            and self._free_map.find(0, after + 1, after + 1 + n) == -1  # the n pages after `after` all free
        blocks = list(range(after + 1, after + 1 + n)) if follows else self._place(n)
        for block in blocks:
            self._ref_counts[block] = 1
            self._free_map[block] = 0
        self._num_free -= n
        return blocks

    def _place(self, n: int) -> list[int]:
        """`n` free pages for a new run: one stretch of the largest free run if it
        is long enough, else pieces of the free runs, longest first."""
        runs = sorted(self.free_runs(), key=lambda run: -run[1])  # stable: lowest first among equals
        first, length = runs[0] if runs else (0, 0)
        if length >= n:
            start = first if first == 0 else first + (length - n) // 2
            return list(range(start, start + n))
        blocks: list[int] = []
        for first, length in runs:
            blocks += range(first, first + min(length, n - len(blocks)))
        return blocks

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as `(first_page, num_pages)` runs, in id order."""
        runs, free = [], self._free_map
        start = free.find(1)
        while start != -1:
            end = free.find(0, start)
            end = len(free) if end == -1 else end
            runs.append((start, end - start))
            start = free.find(1, end)
        return runs

    def ref_counts_view(self) -> list[int]:
        """The live reference counts by page (not a copy: read it, never write it),
        for loops over many pages that `ref_count`'s checks would slow."""
        return self._ref_counts

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    def incref(self, block: int) -> None:
        """Add a holder to an allocated page (a fork shares it)."""
        self._check_allocated(block)
        self._ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """Drop one holder; the page becomes free at count 0."""
        self._check_allocated(block)
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free_map[block] = 1
            self._num_free += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each page in `blocks`."""
        for block in blocks:
            self.decref(block)

    def snapshot(self) -> BlockPoolState:
        free = tuple(page for first, length in self.free_runs() for page in range(first, first + length))
        return BlockPoolState(free, tuple(self._ref_counts))

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"page id {block} is outside the pool of {self.num_blocks} pages")

    def _check_allocated(self, block: int) -> None:
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"page {block} is free; only allocated pages can be shared or released")
