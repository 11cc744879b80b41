"""Cache bookkeeping and storage: paged attention KV and Mamba state rings."""

from .block_pool import BlockPool, BlockPoolState
from .paged_kv import KVCacheBookkeeping, KVWriteMeta, PagedKVCache
from .state_pool import MambaStateShape, StatePool, StatePoolBookkeeping

__all__ = [
    "BlockPool",
    "BlockPoolState",
    "KVCacheBookkeeping",
    "KVWriteMeta",
    "MambaStateShape",
    "PagedKVCache",
    "StatePool",
    "StatePoolBookkeeping",
]
