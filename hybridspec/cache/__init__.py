"""Cache bookkeeping and storage: paged attention KV (the Mamba state rings are
`hybridspec.cache.state_pool`), and `HybridCache`, both for one model; what
each layer kind keeps per sequence, and its bytes, is `hybridspec.cache.state_specs`."""

from hybridspec.cache.block_pool import BlockPool, BlockPoolState
from hybridspec.cache.paged_kv import KVCacheBookkeeping, KVWriteMeta, PagedKVCache

__all__ = [
    "BlockPool",
    "BlockPoolState",
    "KVCacheBookkeeping",
    "KVWriteMeta",
    "PagedKVCache",
]
