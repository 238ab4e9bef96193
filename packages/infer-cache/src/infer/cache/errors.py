"""What a pool raises when asked for something it cannot do.

Every error is a ValueError subclass so callers that only care "the request was bad" can catch
one type; the engine catches `CacheFullError` alone, to queue a request instead of failing it.
"""


class CacheError(ValueError):
    """Base of every error a KV pool or allocator raises."""


class CacheFullError(CacheError):
    """allocate() found no free block or slot; free one (retire or preempt a request) first."""


class DoubleFreeError(CacheError):
    """free() was given a block that is already free; the pool is left unchanged."""


class ForeignBlockError(CacheError):
    """A block id that this pool never hands out (out of range, or not an integer)."""
