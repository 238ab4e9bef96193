"""SlotAllocator by example; the randomized invariants are the allocator contract (conformance)."""

import pytest

from infer.cache import CacheFullError, DoubleFreeError, ForeignBlockError, SlotAllocator


def test_hands_out_lowest_free_id_first():
    allocator = SlotAllocator(3)
    assert [allocator.allocate("a"), allocator.allocate("b")] == [0, 1]
    allocator.free(0)
    assert allocator.allocate("c") == 0


def test_full_pool_raises_and_names_the_fix():
    allocator = SlotAllocator(1)
    allocator.allocate("a")
    with pytest.raises(CacheFullError, match="all 1 blocks are in use"):
        allocator.allocate("b")
    assert allocator.num_used == 1


def test_double_free_raises_and_changes_nothing():
    allocator = SlotAllocator(2)
    block = allocator.allocate("a")
    allocator.free(block)
    with pytest.raises(DoubleFreeError, match=f"block {block} is already free"):
        allocator.free(block)
    assert (allocator.num_free, allocator.num_used) == (2, 0)


@pytest.mark.parametrize("block", [-1, 2, 10**9, "0", 1.0, None])
def test_foreign_ids_raise(block):
    allocator = SlotAllocator(2)
    with pytest.raises(ForeignBlockError):
        allocator.free(block)
    with pytest.raises(ForeignBlockError):
        allocator.owner_of(block)


def test_owner_tracking_and_audit():
    allocator = SlotAllocator(4)
    blocks = {owner: allocator.allocate(owner) for owner in ("a", "b", "c")}
    assert {owner: allocator.owner_of(block) for owner, block in blocks.items()} == {o: o for o in blocks}
    assert allocator.owner_of(3) is None
    assert allocator.owned_by("b") == [blocks["b"]]
    assert allocator.audit(live_owners={"b"}) == sorted([blocks["a"], blocks["c"]])
    assert allocator.audit(live_owners={"a", "b", "c"}) == []


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        SlotAllocator(0)
