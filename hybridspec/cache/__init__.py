"""Cache bookkeeping and storage: paged attention KV (the Mamba state rings are
`hybridspec.checkpoints.state_pool`), and `HybridCache`, both for one model."""

from .block_pool import BlockPool, BlockPoolState
from .paged_kv import KVCacheBookkeeping, KVWriteMeta, PagedKVCache

__all__ = [
    "BlockPool",
    "BlockPoolState",
    "KVCacheBookkeeping",
    "KVWriteMeta",
    "PagedKVCache",
]
