"""`EngineMemory`: what an Engine's pools hold right now (`Engine.memory()`),
read-only, for a server's /metrics and for tests, so that nothing outside the
engine reads its pools' internals."""
from __future__ import annotations

from dataclasses import dataclass

from hybridspec.deprecated import renamed_fields
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.prefix_cache import PrefixStore


@renamed_fields({"prefix_checkpoint_bytes": "prefix_saved_state_bytes"})  # "checkpoint" names the ring snapshots
@dataclass(frozen=True)
class CacheMemory:
    """One model's cache: KV pages (0 of 0 for a model without attention),
    state rings (one per running sequence; 0 of 0 without recurrent layers),
    and what its prefix cache holds (pages among the used ones, bytes of
    saved states; 0 with the prefix cache off)."""

    kv_pages_total: int
    kv_pages_free: int
    rings_total: int
    rings_free: int
    prefix_cached_pages: int
    prefix_saved_state_bytes: int
    kv_bytes_per_page: int

    @property
    def kv_pages_used(self) -> int:
        return self.kv_pages_total - self.kv_pages_free

    @property
    def rings_used(self) -> int:
        return self.rings_total - self.rings_free

    @property
    def prefix_cache_bytes(self) -> int:
        """Pages the prefix cache holds (their K/V) plus its saved states."""
        return self.prefix_cached_pages * self.kv_bytes_per_page + self.prefix_saved_state_bytes


@dataclass(frozen=True)
class EngineMemory:
    target: CacheMemory
    drafter: CacheMemory | None  # a model drafter's own cache; None for plain engines and n-gram drafters

    def is_idle(self) -> bool:
        """Nothing but cached prefixes holds a page or a ring."""
        return all(c.rings_used == 0 and c.kv_pages_used == c.prefix_cached_pages
                   for c in (self.target, self.drafter) if c is not None)


def cache_memory(cache: HybridCache, prefix: PrefixStore | None) -> CacheMemory:
    kv, states = cache.kv, cache.states
    return CacheMemory(
        kv_pages_total=0 if kv is None else kv.num_blocks, kv_pages_free=0 if kv is None else kv.num_free_blocks,
        rings_total=0 if states is None else states.max_seqs, rings_free=0 if states is None else states.num_free_rings,
        prefix_cached_pages=0 if prefix is None else len(prefix.cached_pages()),
        prefix_saved_state_bytes=0 if prefix is None else prefix.saved_state_bytes,
        kv_bytes_per_page=0 if kv is None else kv.bytes_per_block)
