"""KVCacheManager: a request's blocks grow with its tokens, and every call that cannot be served
changes nothing."""

import pytest

from infer.cache import BlockAllocator
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
    assert len(r.block_ids) == -(-num_tokens // BLOCK_SIZE)
    assert manager.allocator.owned_by("r") == r.block_ids


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
    assert (r.block_ids, r.num_computed_tokens) == ([2], 1)
    assert manager.num_free_blocks == 0
    assert manager.allocator.owned_by("r") == [2]


def test_free_returns_every_block_and_empties_block_ids():
    manager, r = make_manager(num_blocks=8), request()
    grow(manager, r, 5 * BLOCK_SIZE)
    manager.free(r)
    assert r.block_ids == []
    assert manager.num_free_blocks == 8
    assert manager.allocator.audit([]) == []


def test_rollback_forgets_tokens_and_frees_the_blocks_they_alone_needed():
    manager, r = make_manager(), request()
    grow(manager, r, 2 * BLOCK_SIZE + 3)
    freed = manager.rollback(r, 4)
    assert (r.num_computed_tokens, len(r.block_ids)) == (2 * BLOCK_SIZE - 1, 2)
    assert manager.allocator.refcount(freed[0]) == 0
    with pytest.raises(ValueError, match="can roll back 0..31"):
        manager.rollback(r, 32)


def test_match_finds_nothing_until_the_prefix_tree_lands():
    manager, r = make_manager(), request(prompt_tokens=40)
    assert manager.match(r) == 0
    assert manager.num_free_blocks == manager.num_blocks


def test_usage_ratio_and_blocks_for_tokens_speak_for_the_pool():
    manager = make_manager(num_blocks=4)
    grow(manager, request(), BLOCK_SIZE + 1)
    assert manager.usage_ratio == 0.5
    assert [manager.blocks_for_tokens(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
