"""KV cache pools and their block allocator. Depends on torch only."""

from infer.cache._version import INTERFACE_VERSION, __version__
from infer.cache.block_allocator import BlockAllocator
from infer.cache.errors import (
    CacheError,
    CacheFullError,
    DoubleFreeError,
    ForeignBlockError,
    LockError,
    OwnerError,
    UnallocatedBlockError,
)
from infer.cache.host_store import HostKVStore
from infer.cache.kv_pool import (
    COPY,
    OFFLOAD,
    RESTORE,
    BlockOp,
    BlockOpKind,
    PagedKVPool,
    kv_budget_from_free_memory,
    num_blocks_for_memory,
)
from infer.cache.kv_quant import QuantizedKVStore
from infer.cache.prefix_tree import MISS, MatchKind, PrefixEntry, PrefixMatch, PrefixTree
from infer.cache.protocol import BlockAllocatorProtocol, KVPool
from infer.cache.shape import KVCacheShape

__all__ = [
    "COPY",
    "OFFLOAD",
    "RESTORE",
    "INTERFACE_VERSION",
    "BlockAllocator",
    "BlockOp",
    "BlockOpKind",
    "BlockAllocatorProtocol",
    "CacheError",
    "CacheFullError",
    "DoubleFreeError",
    "ForeignBlockError",
    "HostKVStore",
    "KVCacheShape",
    "KVPool",
    "LockError",
    "MISS",
    "MatchKind",
    "OwnerError",
    "PagedKVPool",
    "PrefixEntry",
    "PrefixMatch",
    "PrefixTree",
    "QuantizedKVStore",
    "UnallocatedBlockError",
    "__version__",
    "kv_budget_from_free_memory",
    "num_blocks_for_memory",
]
