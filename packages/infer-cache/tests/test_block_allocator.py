"""BlockAllocator by example, then a seeded random walk against a plain-dict model.

The randomized contract (every clause, both implementations) is specs/allocator, run by
`pytest conformance`.
"""

import random

import pytest

from infer.cache import (
    BlockAllocator,
    CacheError,
    CacheFullError,
    DoubleFreeError,
    ForeignBlockError,
    OwnerError,
    UnallocatedBlockError,
)


def state(allocator: BlockAllocator):
    ids = range(allocator.num_blocks)
    return allocator.num_free, [allocator.refcount(b) for b in ids], [allocator.owners_of(b) for b in ids]


def test_fresh_pool_hands_out_lowest_ids_in_order_and_reuses_freed_ones_last():
    allocator = BlockAllocator(4)
    assert allocator.allocate(2, "a") == [0, 1]
    allocator.free([0], "a")
    assert allocator.allocate(3, "b") == [2, 3, 0]


def test_allocate_is_all_or_nothing():
    allocator = BlockAllocator(3)
    allocator.allocate(2, "a")
    before = state(allocator)
    with pytest.raises(CacheFullError, match="asked for 2 blocks for 'b' but only 1 of 3 are free"):
        allocator.allocate(2, "b")
    assert state(allocator) == before
    assert allocator.allocate(0, "b") == []


def test_share_adds_a_reference_and_copies_nothing():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2, "parent")
    allocator.share(allocator.owned_by("parent"), "child")
    assert [allocator.refcount(b) for b in blocks] == [2, 2]
    assert allocator.owners_of(blocks[0]) == ["child", "parent"]
    assert (allocator.num_free, allocator.num_used) == (2, 2)
    assert allocator.free_owner("parent") == blocks
    assert allocator.owned_by("child") == blocks and allocator.num_free == 2
    assert allocator.free_owner("child") == blocks
    assert allocator.num_free == 4


def test_share_refuses_free_blocks_and_blocks_already_held():
    allocator = BlockAllocator(3)
    allocator.allocate(1, "a")
    with pytest.raises(UnallocatedBlockError, match="block 2 is free"):
        allocator.share([0, 2], "b")
    with pytest.raises(OwnerError, match="'a' already holds block 0"):
        allocator.share([0], "a")
    assert allocator.refcount(0) == 1 and allocator.owned_by("b") == []


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(3)
    allocator.allocate(2, "a")
    allocator.free([1], "a")
    before = state(allocator)
    with pytest.raises(DoubleFreeError, match="block 1 is already free"):
        allocator.free([0, 1], "a")  # block 0 is valid, but the call frees nothing
    assert state(allocator) == before


def test_free_by_an_owner_that_does_not_hold_the_block_names_the_owner():
    allocator = BlockAllocator(2)
    allocator.allocate(1, "a")
    with pytest.raises(OwnerError, match=r"'b' does not hold block 0 \(held by \['a'\]\)"):
        allocator.free([0], "b")
    with pytest.raises(OwnerError, match="more than once"):
        allocator.free([0, 0], "a")
    assert allocator.refcount(0) == 1


@pytest.mark.parametrize("block", [-1, 2, 10**9, "0", 1.5, None])
def test_foreign_ids_raise_everywhere(block):
    allocator = BlockAllocator(2)
    allocator.allocate(1, "a")
    for call in (
        lambda: allocator.free([0, block], "a"),
        lambda: allocator.share([block], "b"),
        lambda: allocator.refcount(block),
        lambda: allocator.owners_of(block),
    ):
        with pytest.raises(ForeignBlockError):
            call()
    assert allocator.owned_by("a") == [0]


def test_audit_reads_and_reclaim_frees_the_leaks():
    allocator = BlockAllocator(6)
    allocator.allocate(2, "finished")
    running = allocator.allocate(1, "running")
    allocator.share([0], "running")  # a leaked block a live owner shares stays allocated
    assert allocator.audit(live_owners={"running"}) == [0, 1]
    assert allocator.num_used == 3
    assert allocator.reclaim(live_owners={"running"}) == [0, 1]
    assert allocator.audit(live_owners={"running"}) == []
    assert allocator.owned_by("running") == [*running, 0]
    assert (allocator.refcount(0), allocator.refcount(1), allocator.num_used) == (1, 0, 2)


def test_free_owner_of_an_unknown_owner_returns_nothing():
    assert BlockAllocator(1).free_owner("nobody") == []


def test_counts_and_usage_ratio():
    allocator = BlockAllocator(4)
    allocator.allocate(3, "a")
    assert (allocator.num_blocks, allocator.num_free, allocator.num_used, allocator.usage_ratio) == (
        4,
        1,
        3,
        0.75,
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match="num_blocks must be >= 0, got -1"):
        BlockAllocator(2).allocate(-1, "a")
    with pytest.raises(ValueError, match="owner must be a non-empty string"):
        BlockAllocator(2).allocate(1, "")


def test_random_walk_matches_a_dict_model():
    rng = random.Random(0)
    num_blocks, owners = 8, ["a", "b", "c", "d"]
    allocator = BlockAllocator(num_blocks)
    model: dict[str, list[int]] = {owner: [] for owner in owners}  # owner -> blocks in order
    for _ in range(3000):
        owner, other = rng.sample(owners, 2)
        held = {b for blocks in model.values() for b in blocks}
        action = rng.choice(["allocate", "share", "free", "free_owner", "misuse"])
        if action == "allocate":
            n = rng.randint(0, 3)
            if n > num_blocks - len(held):
                with pytest.raises(CacheFullError):
                    allocator.allocate(n, owner)
            else:
                blocks = allocator.allocate(n, owner)
                assert not held & set(blocks) and len(set(blocks)) == n
                model[owner] += blocks
        elif action == "share":
            blocks = [b for b in model[other] if b not in model[owner]]
            allocator.share(blocks, owner)
            model[owner] += blocks
        elif action == "free" and model[owner]:
            blocks = rng.sample(model[owner], rng.randint(1, len(model[owner])))
            allocator.free(blocks, owner)
            model[owner] = [b for b in model[owner] if b not in blocks]
        elif action == "free_owner":
            assert allocator.free_owner(owner) == model[owner]
            model[owner] = []
        elif action == "misuse":
            with pytest.raises(CacheError):
                allocator.free([rng.randrange(num_blocks)] * 2, owner)
        refcounts = {b: sum(b in blocks for blocks in model.values()) for b in range(num_blocks)}
        assert [allocator.refcount(b) for b in range(num_blocks)] == list(refcounts.values())
        assert (
            allocator.num_used == sum(1 for n in refcounts.values() if n) == num_blocks - allocator.num_free
        )
        assert all(allocator.owned_by(o) == model[o] for o in owners)
        assert all(
            allocator.owners_of(b) == sorted(o for o in owners if b in model[o]) for b in range(num_blocks)
        )
