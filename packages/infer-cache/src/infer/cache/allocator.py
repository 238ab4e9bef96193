"""Which block ids of a fixed-size pool are free, and who owns the others. No tensors.

One id is one slot of `SlottedKVCache` today, one block of the paged pool later: the bookkeeping
is the same, only what an id addresses differs. Ids are handed out lowest first, so a freshly
built pool is deterministic and a test can predict the first ids.
"""

import heapq
import operator
from collections.abc import Collection

from infer.cache.errors import CacheFullError, DoubleFreeError, ForeignBlockError


class SlotAllocator:
    """Hands out ids 0..capacity-1 to named owners and takes them back.

    Invariants (specs/allocator): an id is either free or owned by exactly one owner;
    num_free + num_used == capacity; a failed call changes nothing.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        # A min-heap, so allocate() always returns the lowest free id.
        self._free_ids = list(range(capacity))
        self._owners: dict[int, str] = {}

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return len(self._owners)

    @property
    def usage_ratio(self) -> float:
        return self.num_used / self._capacity

    def allocate(self, owner: str) -> int:
        """Takes the lowest free id for `owner`. Raises CacheFullError when none is free."""
        if not self._free_ids:
            raise CacheFullError(
                f"all {self._capacity} blocks are in use, cannot allocate for {owner!r}; "
                "free a block (retire or preempt a request) or build a larger pool"
            )
        block = heapq.heappop(self._free_ids)
        self._owners[block] = owner
        return block

    def free(self, block: int) -> None:
        """Returns `block` to the pool. Raises DoubleFreeError if it is free already."""
        block = self._check_id(block)
        if block not in self._owners:
            raise DoubleFreeError(f"block {block} is already free; free each allocated block exactly once")
        del self._owners[block]
        heapq.heappush(self._free_ids, block)

    def owner_of(self, block: int) -> str | None:
        """Who allocated `block`, or None while it is free."""
        return self._owners.get(self._check_id(block))

    def owned_by(self, owner: str) -> list[int]:
        """Every block `owner` holds, lowest first."""
        return sorted(block for block, holder in self._owners.items() if holder == owner)

    def audit(self, live_owners: Collection[str]) -> list[int]:
        """Blocks held by owners not in `live_owners` (finished requests that never freed), sorted.

        Reads only; the caller decides whether to free the leaks or fail.
        """
        live = set(live_owners)
        return sorted(block for block, owner in self._owners.items() if owner not in live)

    def _check_id(self, block: int) -> int:
        try:
            index = operator.index(block)
        except TypeError:
            raise ForeignBlockError(f"block id must be an integer, got {block!r}") from None
        if not 0 <= index < self._capacity:
            raise ForeignBlockError(
                f"block id {index} is outside this pool's ids 0..{self._capacity - 1}; "
                "pass an id that this pool's allocate() returned"
            )
        return index
