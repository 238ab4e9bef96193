"""The allocator checks catch real bugs: each broken allocator below fails its own clause's check."""

import pytest

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from conformance.state_machines import failure_messages
from infer.cache import BlockAllocator, PagedKVPool

checks = load_checks_module(CHECKS_DIR, "allocator")
FAST = {"num_blocks": 3, "max_examples": 100, "steps": 20}


class AcceptsDoubleFree(BlockAllocator):
    def free(self, block_ids, owner):
        block_ids = list(block_ids)
        if any(b in range(self.num_blocks) and b not in self._holders for b in block_ids):
            return  # silently, instead of DoubleFreeError
        super().free(block_ids, owner)


class HandsOutHeldBlocks(BlockAllocator):
    """allocate(1) lends a block another owner holds, as if it were free (bookkeeping kept)."""

    def allocate(self, num_blocks, owner):
        held_by_others = [b for b, holders in self._holders.items() if owner not in holders]
        if num_blocks == 1 and held_by_others:
            self.share(held_by_others[:1], owner)
            return held_by_others[:1]
        return super().allocate(num_blocks, owner)


class TakesWhatItCanWhenFull(BlockAllocator):
    def allocate(self, num_blocks, owner):
        return super().allocate(min(num_blocks, self.num_free), owner)


class MiscountsFree(BlockAllocator):
    @property
    def num_free(self):
        return super().num_free + (1 if self.num_used == 2 else 0)


class ForgetsOwners(BlockAllocator):
    def owners_of(self, block):
        return [owner for owner in super().owners_of(block) if owner != "req-2"]


class AuditsLiveOwners(BlockAllocator):
    def audit(self, live_owners):
        return sorted(self._holders)


class IndexErrorOnNegative(BlockAllocator):
    def refcount(self, block):
        if isinstance(block, int) and block < 0:
            raise IndexError(block)
        return super().refcount(block)


class RoundsUsageRatio(BlockAllocator):
    @property
    def usage_ratio(self):
        return round(super().usage_ratio, 1)


class NegativeRefcountWhenFree(BlockAllocator):
    def refcount(self, block):
        return super().refcount(block) or -1


class FreesSharedBlocks(BlockAllocator):
    """Puts a block back on the free list when any owner frees it, though others still hold it."""

    def _release(self, block, owner):
        shared = len(self._holders[block]) > 1
        super()._release(block, owner)
        if shared:
            self._free.append(block)


class FreeDropsEveryHolder(BlockAllocator):
    """One owner's free of a shared block drops every owner's reference."""

    def _release(self, block, owner):
        others = sorted(self._holders[block] - {owner})
        super()._release(block, owner)
        for other in others:
            super()._release(block, other)


class ShareCopies(BlockAllocator):
    """share() gives the new owner fresh blocks (a copy) whenever enough are free."""

    def share(self, block_ids, owner):
        block_ids = list(block_ids)
        if len(block_ids) <= self.num_free:
            self.allocate(len(block_ids), owner)
        else:
            super().share(block_ids, owner)


class FreeOwnerReturnsOnlyFreed(BlockAllocator):
    def free_owner(self, owner):
        return [block for block in super().free_owner(owner) if self.refcount(block) == 0]


class SharesFreeBlocks(BlockAllocator):
    def share(self, block_ids, owner):
        super().share([b for b in block_ids if b not in range(self.num_blocks) or b in self._holders], owner)


class LendsNullBlock(PagedKVPool):
    def __init__(self, shape, num_blocks):
        super().__init__(shape, num_blocks)
        self.allocator = BlockAllocator(num_blocks + 1)


@pytest.mark.parametrize(
    ("broken", "check", "says"),
    [
        (AcceptsDoubleFree, checks.double_free_raises, "did not raise DoubleFreeError"),
        (HandsOutHeldBlocks, checks.unique_ownership, "which are still referenced"),
        (HandsOutHeldBlocks, checks.no_reuse_while_referenced, "which are still referenced"),
        (TakesWhatItCanWhenFull, checks.full_pool_raises, "did not raise CacheFullError"),
        (MiscountsFree, checks.conservation, "!= num_blocks"),
        (ForgetsOwners, checks.owner_tracking, "owners_of per block"),
        (AuditsLiveOwners, checks.audit_finds_leaks, "expected []"),
        (
            IndexErrorOnNegative,
            checks.foreign_block_raises,
            "raised IndexError(-1), expected ForeignBlockError",
        ),
        (RoundsUsageRatio, checks.usage_ratio, "of 3 held"),
        (NegativeRefcountWhenFree, checks.refcount_never_negative, "refcount per block"),
        (FreesSharedBlocks, checks.no_reuse_while_referenced, "which are still referenced"),
        (FreeDropsEveryHolder, checks.fork_shares_blocks, "after frees of other owners"),
        (ShareCopies, checks.fork_shares_blocks, ("(refcounts, num_free)", "after frees of other owners")),
        (FreeOwnerReturnsOnlyFreed, checks.free_owner_returns_all, "the owner held"),
        (SharesFreeBlocks, checks.share_free_block_raises, "did not raise UnallocatedBlockError"),
    ],
    ids=lambda value: getattr(value, "__name__", "says"),
)
def test_broken_allocator_fails_its_check(monkeypatch, broken, check, says):
    monkeypatch.setitem(checks.ALLOCATORS, "Broken", broken)
    alternatives = (says,) if type(says) is str else says
    messages = failure_messages(check, FAST, "Broken", alternatives)
    assert any(fragment in message for fragment in alternatives for message in messages), (
        f"expected a failure saying {says!r}, got {messages}"
    )


def test_a_pool_that_lends_its_null_block_fails_its_check(monkeypatch):
    monkeypatch.setitem(checks.KV_POOLS, "Broken", lambda n: LendsNullBlock(checks.TINY_SHAPE, n))
    messages = failure_messages(checks.null_block_never_handed_out, FAST, "Broken", ("null",))
    assert any("null" in message for message in messages), messages


def test_a_bug_fails_only_the_clauses_it_breaks(monkeypatch):
    # An allocator that accepts a double free still conserves counts on valid calls.
    monkeypatch.setitem(checks.ALLOCATORS, "Broken", AcceptsDoubleFree)
    checks.usage_ratio(FAST, "Broken")
    checks.conservation(FAST, "Broken")
