"""KV cache pools and allocators. Depends on torch only."""

from infer.cache._version import INTERFACE_VERSION, __version__
from infer.cache.allocator import SlotAllocator
from infer.cache.contiguous import ContiguousKVCache, KVCacheShape
from infer.cache.errors import CacheError, CacheFullError, DoubleFreeError, ForeignBlockError
from infer.cache.protocol import KVPool
from infer.cache.slotted import SlottedKVCache

__all__ = [
    "INTERFACE_VERSION",
    "CacheError",
    "CacheFullError",
    "ContiguousKVCache",
    "DoubleFreeError",
    "ForeignBlockError",
    "KVCacheShape",
    "KVPool",
    "SlotAllocator",
    "SlottedKVCache",
    "__version__",
]
