"""Block pool: the free list and reference counts of the KV pages.

A page (block) holds the K/V entries of `block_size` consecutive tokens of one
sequence in every attention layer. A page may be listed in several block
tables at once (after a fork); its reference count is the number of tables
that hold it, and it returns to the free list when that count drops to 0.
This module is bookkeeping only: page ids and counts, no tensors.
"""

from collections import deque
from dataclasses import dataclass

from hybridspec.errors import CacheFullError


@dataclass(frozen=True)
class BlockPoolState:
    """An immutable copy of the pool's bookkeeping, comparable with `==`."""

    free_blocks: tuple[int, ...]  # in allocation order
    ref_counts: tuple[int, ...]  # [num_blocks]


class BlockPool:
    """Free list plus reference counts over pages `0 .. num_blocks - 1`."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: a block pool needs at least one page")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with reference count 1; all or nothing."""
        if n < 0:
            raise ValueError(f"allocate(n={n}): n must be >= 0")
        if not self.can_allocate(n):
            raise CacheFullError(
                f"need {n} free KV pages but only {len(self._free)} of {self.num_blocks} are free; "
                "raise num_blocks or run a smaller batch"
            )
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    def incref(self, block: int) -> None:
        """Add a holder to an allocated page (a fork shares it)."""
        self._check_allocated(block)
        self._ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """Drop one holder; the page returns to the free list at count 0."""
        self._check_allocated(block)
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each page in `blocks`."""
        for block in blocks:
            self.decref(block)

    def snapshot(self) -> BlockPoolState:
        return BlockPoolState(tuple(self._free), tuple(self._ref_counts))

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"page id {block} is outside the pool of {self.num_blocks} pages")

    def _check_allocated(self, block: int) -> None:
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"page {block} is free; only allocated pages can be shared or released")
