"""The allocator checks catch real bugs: each broken pool below fails its own clause's check."""

import pytest

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from infer.cache import SlotAllocator

checks = load_checks_module(CHECKS_DIR, "allocator")
FAST = {"capacity": 3, "max_examples": 30, "steps": 20}


class AcceptsDoubleFree(SlotAllocator):
    def free(self, block):
        if block in self._owners:
            super().free(block)


class HandsOutOwnedBlocks(SlotAllocator):
    def allocate(self, owner):
        block = super().allocate(owner)
        self._free_ids.append(block)  # stays in the free list while owned
        return block


class MiscountsFree(SlotAllocator):
    @property
    def num_free(self):
        return super().num_free + (1 if self.num_used == 2 else 0)


class ForgetsOwners(SlotAllocator):
    def owner_of(self, block):
        owner = super().owner_of(block)
        return None if owner == "req-2" else owner


class AuditsLiveOwners(SlotAllocator):
    def audit(self, live_owners):
        return sorted(self._owners)


class IndexErrorOnNegative(SlotAllocator):
    def free(self, block):
        if isinstance(block, int) and block < 0:
            raise IndexError(block)
        super().free(block)


@pytest.mark.parametrize(
    ("broken_pool", "check"),
    [
        (AcceptsDoubleFree, checks.double_free_raises),
        (HandsOutOwnedBlocks, checks.unique_ownership),
        (MiscountsFree, checks.conservation),
        (ForgetsOwners, checks.owner_tracking),
        (AuditsLiveOwners, checks.audit_finds_leaks),
        (IndexErrorOnNegative, checks.foreign_block_raises),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_broken_pool_fails_its_check(monkeypatch, broken_pool, check):
    monkeypatch.setitem(checks.POOLS, "Broken", broken_pool)
    with pytest.raises((AssertionError, IndexError)):
        check(FAST, "Broken")


def test_a_bug_fails_only_the_clauses_it_breaks(monkeypatch):
    # A pool that accepts a double free still conserves counts on valid calls.
    monkeypatch.setitem(checks.POOLS, "Broken", AcceptsDoubleFree)
    checks.usage_ratio(FAST, "Broken")
