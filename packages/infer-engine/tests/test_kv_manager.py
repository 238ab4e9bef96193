"""KVCacheManager: a request's blocks grow with its tokens, and every call that cannot be served
changes nothing."""

import pytest

from infer.cache import BlockAllocator, PrefixTree
from infer.engine.kv_manager import KVCacheManager
from infer.engine.request import Request
from infer.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_manager(num_blocks: int = 32) -> KVCacheManager:
    return KVCacheManager(BlockAllocator(num_blocks), BLOCK_SIZE)


def request(request_id: str = "r", prompt_tokens: int = 1) -> Request:
    return Request(request_id, [1] * prompt_tokens, SamplingParams(max_new_tokens=256))


def grow(manager: KVCacheManager, r: Request, num_tokens: int) -> list[int] | None:
    """Schedules and computes `num_tokens` more tokens, as the scheduler and update() do."""
    new_block_ids = manager.allocate(r, num_tokens)
    if new_block_ids is not None:
        r.num_computed_tokens += num_tokens
    return new_block_ids


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 33, 256])
def test_a_request_holds_exactly_ceil_tokens_over_block_size_blocks(num_tokens):
    manager, r = make_manager(), request()
    grow(manager, r, num_tokens)
    assert len(manager.block_ids("r")) == -(-num_tokens // BLOCK_SIZE)
    assert manager.allocator.owned_by("r") == list(manager.block_ids("r"))


def test_a_block_is_taken_only_when_a_token_crosses_a_block_boundary():
    manager, r = make_manager(), request()
    taken_at = [position for position in range(3 * BLOCK_SIZE) if grow(manager, r, 1)]
    assert taken_at == [0, BLOCK_SIZE, 2 * BLOCK_SIZE]


def test_allocate_covers_lookahead_tokens_too():
    manager, r = make_manager(), request()
    assert len(manager.allocate(r, 10, num_lookahead_tokens=10)) == 2


def test_allocate_returns_none_and_changes_nothing_when_the_pool_is_short():
    manager = make_manager(num_blocks=3)
    holder, r = request("holder"), request("r")
    grow(manager, holder, 2 * BLOCK_SIZE)
    grow(manager, r, 1)
    assert manager.allocate(r, 2 * BLOCK_SIZE) is None
    assert (manager.block_ids("r"), r.num_computed_tokens) == ((2,), 1)
    assert manager.num_free_blocks == 0
    assert manager.allocator.owned_by("r") == [2]


def test_free_returns_every_block_and_empties_block_ids():
    manager, r = make_manager(num_blocks=8), request()
    grow(manager, r, 5 * BLOCK_SIZE)
    manager.free(r)
    assert manager.block_ids("r") == ()
    assert manager.num_free_blocks == 8
    assert manager.allocator.audit([]) == []


def test_rollback_frees_the_blocks_the_remaining_tokens_no_longer_need():
    manager, r = make_manager(), request()
    grow(manager, r, 2 * BLOCK_SIZE + 3)
    freed = manager.rollback(r, 4)
    assert r.num_computed_tokens == 2 * BLOCK_SIZE + 3  # the caller (the scheduler) moves it
    r.num_computed_tokens -= 4
    assert len(manager.block_ids("r")) == 2
    assert manager.allocator.owned_by("r") == list(manager.block_ids("r"))
    assert len(freed) == 1 and manager.allocator.refcount(freed[0]) == 0
    with pytest.raises(ValueError, match="can roll back 0..31"):
        manager.rollback(r, 32)


def test_rolling_back_every_token_frees_every_block():
    manager, r = make_manager(num_blocks=8), request()
    grow(manager, r, BLOCK_SIZE + 1)
    assert len(manager.rollback(r, BLOCK_SIZE + 1)) == 2
    assert manager.block_ids("r") == () and manager.num_free_blocks == 8


def test_without_a_prefix_tree_match_finds_nothing():
    manager, r = make_manager(), request(prompt_tokens=40)
    assert manager.match(r).num_tokens == 0
    assert manager.acquire(r, manager.match(r)) == 0
    assert manager.block_ids("r") == ()
    assert manager.num_free_blocks == manager.num_blocks


def cached_manager(num_blocks: int = 32) -> KVCacheManager:
    allocator = BlockAllocator(num_blocks)
    return KVCacheManager(allocator, BLOCK_SIZE, PrefixTree(allocator, BLOCK_SIZE))


def test_a_finished_request_leaves_its_computed_tokens_and_the_next_one_takes_them():
    manager = cached_manager()
    first = Request("first", list(range(40)), SamplingParams())
    grow(manager, first, 40)
    first.output_ids = [7]  # sampled; its K/V was never computed
    manager.free(first)
    assert manager.allocator.num_used == 3 == manager.prefix_tree.num_blocks  # 40 tokens, the tree's
    second = Request("second", list(range(40)) + [9, 9], SamplingParams())
    # 32 tokens in two shared blocks, 8 copied into a block of its own.
    assert manager.acquire(second, manager.match(second)) == 40
    assert second.num_computed_tokens == second.num_cached_tokens == 0  # the scheduler counts them
    blocks = manager.block_ids("second")
    assert blocks[:2] == manager.prefix_tree.match(list(range(32))).block_ids
    ((kind, source, target),) = manager.take_block_ops()
    assert kind == "copy" and target == blocks[2] and source not in blocks
    assert manager.match_counts["prefix"] == 1
    # The match (shared blocks and the copy's source) is locked: none of it can be evicted
    # while the request runs, so only the free list counts.
    assert manager.num_free_blocks == manager.allocator.num_free == 32 - 3 - 1


def test_allocate_evicts_the_cache_when_the_free_list_is_short():
    manager = cached_manager(num_blocks=4)
    first = Request("first", list(range(48)), SamplingParams())
    grow(manager, first, 48)
    manager.free(first)
    assert manager.allocator.num_free == 1 and manager.num_free_blocks == 4
    other = Request("other", [5] * 60, SamplingParams())
    assert grow(manager, other, 60) is not None
    assert manager.prefix_tree.num_blocks == 0 and manager.prefix_tree.num_evicted_blocks == 3


def test_release_undoes_an_admission_that_did_not_happen():
    manager = cached_manager()
    first = Request("first", list(range(20)), SamplingParams())
    grow(manager, first, 20)
    manager.free(first)
    second = Request("second", list(range(20)), SamplingParams())
    assert manager.acquire(second, manager.match(second)) == 19 and manager.match_counts["prefix"] == 1
    manager.release(second)
    assert manager.block_ids("second") == ()
    assert manager.take_block_ops() == () and manager.match_counts["prefix"] == 0
    assert manager.prefix_tree.num_locked_blocks == 0 and manager.allocator.num_used == 2


def test_usage_ratio_and_blocks_for_tokens_speak_for_the_pool():
    manager = make_manager(num_blocks=4)
    grow(manager, request(), BLOCK_SIZE + 1)
    assert manager.usage_ratio == 0.5
    assert [manager.blocks_for_tokens(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_a_running_request_gives_its_computed_prompt_blocks_to_the_next_one():
    manager = cached_manager()
    first = Request("first", list(range(40)), SamplingParams())
    grow(manager, first, 24)  # one prefill chunk: one whole block and 8 tokens
    manager.cache_computed(first)
    tree = manager.prefix_tree
    assert tree.block_ids() == list(manager.block_ids("first")[:1])
    # The tree's blocks are first's too: locked while it runs, so none is counted free.
    assert tree.num_locked_blocks == 1 and manager.num_free_blocks == manager.allocator.num_free
    grow(manager, first, 16)
    manager.cache_computed(first)
    assert tree.block_ids() == sorted(manager.block_ids("first")[:2]) and tree.num_locked_blocks == 2
    second = Request("second", list(range(40)) + [1], SamplingParams())
    assert manager.acquire(second, manager.match(second)) == 32
    assert manager.block_ids("second") == manager.block_ids("first")[:2]
    assert manager.match_counts["lcp"] == 1  # first has not ended there: no prefix of anything
    manager.free(first)
    manager.free(second)
    assert manager.allocator.num_used == tree.num_blocks == 3 and tree.num_locked_blocks == 0


def test_a_failed_request_takes_back_what_it_gave_while_running():
    manager = cached_manager()
    first = Request("first", list(range(40)), SamplingParams())
    grow(manager, first, 40)
    manager.cache_computed(first)
    assert manager.prefix_tree.num_blocks == 2
    manager.free(first, cache=False)
    assert manager.prefix_tree.num_blocks == 0 and manager.allocator.num_used == 0


def int8_manager(num_blocks: int, num_slots: int) -> KVCacheManager:
    allocator = BlockAllocator(num_blocks)
    tree = PrefixTree(allocator, BLOCK_SIZE, slots=BlockAllocator(num_slots), store_min_tokens=0)
    return KVCacheManager(allocator, BLOCK_SIZE, tree)


def test_blocks_idle_past_the_ttl_go_to_a_host_store_with_their_offloads_in_the_next_decision():
    now = [0.0]
    allocator = BlockAllocator(8)
    tree = PrefixTree(
        allocator, BLOCK_SIZE, clock=lambda: now[0], slots=BlockAllocator(8), store_min_tokens=0,
        idle_to_store=True,
    )  # fmt: skip
    manager = KVCacheManager(allocator, BLOCK_SIZE, tree)
    first = Request("first", list(range(48)), SamplingParams())
    grow(manager, first, 48)
    blocks = list(manager.block_ids("first"))
    manager.free(first)
    manager.take_block_ops()
    now[0] = 100.0
    manager.evict_idle(60.0)
    # The blocks are free now, for anyone the next decision admits: their copies must run first.
    ops = manager.take_block_ops()
    assert [kind for kind, _, _ in ops] == ["offload"] * 3
    assert sorted(block for _, block, _ in ops) == sorted(blocks)
    assert allocator.num_used == 0 and tree.num_stored_blocks == 3


def test_blocks_short_move_cached_blocks_to_int8_and_a_hit_restores_them_first():
    manager = int8_manager(num_blocks=4, num_slots=8)
    first = Request("first", list(range(48)), SamplingParams())
    grow(manager, first, 48)
    manager.free(first)
    other = Request("other", [5] * 48, SamplingParams())
    grow(manager, other, 48)  # one free block: two of the tree's go int8 for the other two
    ops = manager.take_block_ops()
    assert [kind for kind, _, _ in ops] == ["offload", "offload"]
    assert {block for _, block, _ in ops} <= set(manager.block_ids("other"))  # written only after the copies
    manager.free(other)
    second = Request("second", list(range(48)) + [1], SamplingParams())
    assert manager.acquire(second, manager.match(second)) == 48
    # The pool is all the tree's: other's blocks go int8 to make room for the restores, which
    # come after them in the step's order, into the blocks they freed.
    ops = manager.take_block_ops()
    assert [kind for kind, _, _ in ops] == ["offload", "offload", "restore", "restore"]
    assert {block for _, block, _ in ops[:2]} == {block for _, _, block in ops[2:]}
    assert list(manager.block_ids("second")[1:3]) == [block for _, _, block in ops[2:]]


def test_a_hit_without_blocks_to_restore_into_waits_and_changes_nothing():
    """Recomputing the stored tokens would take as many blocks as restoring them: the request
    waits (None) until blocks are free, then restores them all."""
    manager = int8_manager(num_blocks=4, num_slots=8)
    first = Request("first", list(range(48)), SamplingParams())
    grow(manager, first, 48)
    manager.free(first)
    other = Request("other", [5] * 48, SamplingParams())
    grow(manager, other, 48)  # holds 3 blocks until the end: no block is left to restore into
    manager.take_block_ops()
    second = Request("second", list(range(48)) + [1], SamplingParams())
    tree = manager.prefix_tree
    before = (
        tree.num_stored_blocks,
        tree.num_locked_blocks,
        manager.allocator.num_used,
        dict(manager.match_counts),
    )
    assert manager.acquire(second, manager.match(second)) is None
    assert manager.take_block_ops() == ()
    after = (
        tree.num_stored_blocks,
        tree.num_locked_blocks,
        manager.allocator.num_used,
        dict(manager.match_counts),
    )
    assert after == before and manager.block_ids("second") == ()
    manager.free(other)
    assert manager.acquire(second, manager.match(second)) == 48
    assert [kind for kind, _, _ in manager.take_block_ops()].count("restore") == 2
    manager.free(second)
    assert tree.num_locked_blocks == 0
