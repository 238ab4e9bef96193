"""What a pool or allocator raises when asked for something it cannot do.

Every error is a ValueError subclass so callers that only care "the request was bad" can catch
one type; the engine catches `CacheFullError` alone, to preempt or queue instead of failing.
A call that raises any of these has changed nothing.
"""


class CacheError(ValueError):
    """Base of every error a KV pool or block allocator raises."""


class CacheFullError(CacheError):
    """allocate(n) found fewer than n free blocks; free some (retire or preempt a request) first."""


class DoubleFreeError(CacheError):
    """free() was given a block that is already free (refcount 0)."""


class ForeignBlockError(CacheError):
    """A block id that this allocator never hands out (out of range, or not an integer)."""


class OwnerError(CacheError):
    """An owner released a block it does not hold, or took a block it already holds."""


class UnallocatedBlockError(CacheError):
    """share() was given a free block: only a block some owner holds can gain a reference."""


class LockError(CacheError):
    """PrefixTree.unlock() of a match that holds no lock: a lock count would go below zero."""
