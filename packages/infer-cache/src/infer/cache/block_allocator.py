"""BlockAllocator: which blocks of a fixed pool are free, and which owners hold the others.

No tensors: a block id is an index into a pool's K/V tensors (PagedKVPool), nothing more.

- Free list: a deque. A fresh allocator hands out 0, 1, 2, ... in order; freed blocks join the
  back, so a block just freed is the last to be reused (its contents stay readable longest).
- References: a block is held by a set of owners (request ids, or a prefix cache); its refcount
  is the number of owners holding it. An owner holds a block at most once. `share()` adds an
  owner (prefix hit, fork), `free()` removes one; at refcount 0 the block is free again.
- Every call validates all its arguments before it changes anything: a call that raises has
  changed nothing.

Costs: allocate and free are O(blocks in the call); free_owner and owned_by are O(blocks of that
owner); audit and reclaim are O(owners + their blocks). Nothing walks the whole pool.
"""

import operator
from collections import Counter, deque
from collections.abc import Collection, Iterable

from infer.cache.errors import (
    CacheFullError,
    DoubleFreeError,
    ForeignBlockError,
    OwnerError,
    UnallocatedBlockError,
)


class BlockAllocator:
    """Lends blocks 0..num_blocks-1 to named owners, with reference counts."""

    def __init__(self, num_blocks: int):
        if operator.index(num_blocks) < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # block -> owners holding it (only blocks with refcount > 0 have an entry).
        self._holders: dict[int, set[str]] = {}
        # owner -> its blocks in the order it got them (a dict as an ordered set); owners that
        # hold nothing have no entry, so finished requests leave no trace.
        self._held: dict[str, dict[int, None]] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._holders)

    @property
    def usage_ratio(self) -> float:
        """Fraction of blocks held (0.0 empty, 1.0 full), the engine's KV usage metric."""
        return self.num_used / self._num_blocks

    def allocate(self, num_blocks: int, owner: str) -> list[int]:
        """`num_blocks` free blocks for `owner`, each with refcount 1; all or nothing.

        Raises CacheFullError (and takes nothing) when fewer are free. 0 returns [].
        """
        if operator.index(num_blocks) < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        _check_owner(owner)
        if num_blocks > len(self._free):
            raise CacheFullError(
                f"asked for {num_blocks} blocks for {owner!r} but only {len(self._free)} of "
                f"{self._num_blocks} are free; free blocks (retire or preempt a request) "
                "or build a larger pool"
            )
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._holders[block] = set()
            self._hold(block, owner)
        return blocks

    def share(self, block_ids: Iterable[int], owner: str) -> None:
        """`owner` takes a reference to each block (refcount + 1); nothing is copied.

        UnallocatedBlockError for a free block, OwnerError for a block `owner` already holds.
        """
        blocks = self._check_ids(block_ids)
        _check_owner(owner)
        for block in blocks:
            if block not in self._holders:
                raise UnallocatedBlockError(
                    f"block {block} is free, {owner!r} cannot share it; share only blocks that an owner holds"
                )
            if owner in self._holders[block]:
                raise OwnerError(
                    f"{owner!r} already holds block {block}; an owner holds a block at most once"
                )
        for block in blocks:
            self._hold(block, owner)

    def free(self, block_ids: Iterable[int], owner: str) -> None:
        """Drops `owner`'s reference to each block; a block at refcount 0 joins the free list.

        ForeignBlockError for an id outside 0..num_blocks-1, DoubleFreeError for a free block,
        OwnerError for a block held only by others.
        """
        blocks = self._check_ids(block_ids)
        for block in blocks:
            if block not in self._holders:
                raise DoubleFreeError(f"block {block} is already free; free each reference exactly once")
            if owner not in self._holders[block]:
                raise OwnerError(
                    f"{owner!r} does not hold block {block} (held by {self.owners_of(block)}); "
                    "free a block with the owner that allocated or shared it"
                )
        for block in blocks:
            self._release(block, owner)

    def free_owner(self, owner: str) -> list[int]:
        """Drops every reference `owner` holds; returns all those blocks, in the order it got them.

        Blocks that other owners still hold stay allocated (refcount(block) tells which went free).
        An owner that holds nothing returns [].
        """
        blocks = list(self._held.get(owner, ()))
        for block in blocks:
            self._release(block, owner)
        return blocks

    def refcount(self, block: int) -> int:
        """How many owners hold `block`; 0 while it is free."""
        return len(self._holders.get(self._check_id(block), ()))

    def owners_of(self, block: int) -> list[str]:
        """The owners holding `block`, sorted; [] while it is free."""
        return sorted(self._holders.get(self._check_id(block), ()))

    def owned_by(self, owner: str) -> list[int]:
        """The blocks `owner` holds, in the order it allocated or shared them."""
        return list(self._held.get(owner, ()))

    def audit(self, live_owners: Collection[str]) -> list[int]:
        """Blocks held by owners not in `live_owners` (leaks of finished requests), sorted. Reads only."""
        live = set(live_owners)
        return sorted({block for owner, held in self._held.items() if owner not in live for block in held})

    def reclaim(self, live_owners: Collection[str]) -> list[int]:
        """Drops every reference of owners not in `live_owners`; returns audit()'s list of those blocks."""
        leaked = self.audit(live_owners)
        live = set(live_owners)
        for owner in [owner for owner in self._held if owner not in live]:
            self.free_owner(owner)
        return leaked

    def _hold(self, block: int, owner: str) -> None:
        self._holders[block].add(owner)
        self._held.setdefault(owner, {})[block] = None

    def _release(self, block: int, owner: str) -> None:
        holders = self._holders[block]
        holders.remove(owner)
        held = self._held[owner]
        del held[block]
        if not held:
            del self._held[owner]
        if not holders:
            del self._holders[block]
            self._free.append(block)

    def _check_ids(self, block_ids: Iterable[int]) -> list[int]:
        blocks = [self._check_id(block) for block in block_ids]
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):  # (a Counter for every call cost more)
            repeated = sorted(block for block, count in Counter(blocks).items() if count > 1)
            raise OwnerError(
                f"blocks {repeated} appear more than once in one call; an owner holds a block at most once"
            )
        return blocks

    def _check_id(self, block: int) -> int:
        try:
            index = operator.index(block)
        except TypeError:
            raise ForeignBlockError(f"block id must be an integer, got {block!r}") from None
        if not 0 <= index < self._num_blocks:
            raise ForeignBlockError(
                f"block id {index} is outside this allocator's ids 0..{self._num_blocks - 1}; "
                "pass an id that allocate() returned"
            )
        return index


def _check_owner(owner: str) -> None:
    if not owner:
        raise ValueError(f"owner must be a non-empty string (a request id), got {owner!r}")
