"""Storage, one place for every pool: paged attention K/V and its block pool, the state pool of
recurrent layers (a ring of slots per sequence) with the state specs of every layer kind (state_specs.py: the bytes of a slot, a log input, a K/V token), the
forward's metadata, `HybridCache` (one model's K/V pages and states), the prefix cache, and what an
engine's pools hold (memory.py)."""

from hybridspec.cache.block_pool import BlockPool, BlockPoolState
from hybridspec.cache.paged_kv import KVCacheBookkeeping, KVWriteMeta, PagedKVCache

__all__ = [
    "BlockPool",
    "BlockPoolState",
    "KVCacheBookkeeping",
    "KVWriteMeta",
    "PagedKVCache",
]
