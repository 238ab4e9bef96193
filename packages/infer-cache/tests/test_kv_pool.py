"""PagedKVPool: the tensors, the reserved null block, and sizing a pool from a memory budget."""

import pytest
import torch

from infer.cache import (
    BlockAllocatorProtocol,
    CacheFullError,
    KVCacheShape,
    KVPool,
    PagedKVPool,
    QuantizedKVStore,
    kv_budget_from_free_memory,
    num_blocks_for_memory,
)

SHAPE = KVCacheShape(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float16, block_size=8)


def test_tensors_have_one_extra_block_and_start_zeroed():
    pool = PagedKVPool(SHAPE, num_blocks=5)
    assert len(pool.kv_layers) == SHAPE.num_layers
    for k_cache, v_cache in pool.kv_layers:
        assert k_cache.shape == v_cache.shape == (6, 8, 3, 4)  # [num_blocks + 1, block_size, Hkv, D]
        assert k_cache.dtype == v_cache.dtype == torch.float16
        assert torch.count_nonzero(k_cache) == torch.count_nonzero(v_cache) == 0


def test_kv_bytes_counts_every_tensor_null_block_included():
    pool = PagedKVPool(SHAPE, num_blocks=5)
    measured = sum(t.numel() * t.element_size() for layer in pool.kv_layers for t in layer)
    # 2 (K, V) * 2 layers * 3 heads * 4 dims * 2 bytes * 8 tokens * 6 blocks
    assert pool.kv_bytes == measured == 2 * 2 * 3 * 4 * 2 * 8 * 6


def test_null_block_is_never_allocated_even_when_drained():
    pool = PagedKVPool(SHAPE, num_blocks=4)
    assert pool.null_block == 4 == pool.allocator.num_blocks
    lent = pool.allocator.allocate(4, "req")
    assert sorted(lent) == [0, 1, 2, 3]
    with pytest.raises(CacheFullError):
        pool.allocator.allocate(1, "other")
    pool.allocator.free_owner("req")
    assert pool.null_block not in pool.allocator.allocate(4, "again")


def test_a_block_is_its_own_memory():
    # The runner scatters new keys by slot; writing one block must leave the others untouched.
    pool = PagedKVPool(SHAPE, num_blocks=3)
    (block,) = pool.allocator.allocate(1, "req")
    k_cache, _ = pool.kv_layers[0]
    k_cache[block] = 1.0
    assert torch.count_nonzero(k_cache) == k_cache[block].numel()


def test_the_contiguous_cache_is_a_pool_with_one_block_per_sequence():
    max_seq_len, max_batch_size = 32, 2
    shape = KVCacheShape(
        num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=max_seq_len
    )
    pool = PagedKVPool(shape, num_blocks=max_batch_size)
    assert shape.blocks_for_tokens(max_seq_len) == 1
    assert pool.kv_layers[0][0].shape == (max_batch_size + 1, max_seq_len, 1, 4)


def test_pool_satisfies_the_protocols():
    pool = PagedKVPool(SHAPE, num_blocks=1)
    assert isinstance(pool, KVPool)
    assert isinstance(pool.allocator, BlockAllocatorProtocol)


def test_num_blocks_for_memory_reserves_the_null_block():
    per_block = SHAPE.bytes_per_block()  # 2 * 2 * 3 * 4 * 2 * 8 = 768
    assert per_block == 768
    assert num_blocks_for_memory(SHAPE, 10 * per_block) == 9
    assert num_blocks_for_memory(SHAPE, 10 * per_block + per_block - 1) == 9
    pool = PagedKVPool(SHAPE, num_blocks_for_memory(SHAPE, 10 * per_block))
    assert pool.kv_bytes == 10 * per_block


def test_num_blocks_for_memory_refuses_a_budget_below_two_blocks():
    with pytest.raises(ValueError, match="fewer than 2 blocks of 768 bytes"):
        num_blocks_for_memory(SHAPE, 2 * 768 - 1)


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        PagedKVPool(SHAPE, num_blocks=0)


def test_free_memory_budget_is_cuda_only():
    with pytest.raises(ValueError, match="pass num_blocks to PagedKVPool explicitly"):
        kv_budget_from_free_memory("cpu", 0.9)


def test_free_memory_budget_takes_a_fraction_of_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 4000))
    assert kv_budget_from_free_memory("cuda:0", 0.5) == 500
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 1.5"):
        kv_budget_from_free_memory("cuda:0", 1.5)


def test_free_memory_budget_is_its_fraction_less_what_serving_needs_besides(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 4000))
    assert kv_budget_from_free_memory("cuda:0", 0.5, held_back_bytes=200) == 300
    assert kv_budget_from_free_memory("cuda:0", 0.5, held_back_bytes=2000) == 0


def test_copy_blocks_copies_every_layer_and_touches_nothing_else():
    import torch

    from infer.cache import KVCacheShape, PagedKVPool

    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=3)
    pool = PagedKVPool(shape, num_blocks=5)
    for k_cache, v_cache in pool.kv_layers:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in pool.kv_layers]
    pool.copy_blocks([(1, 3), (4, 0)])
    for (k, v), (k0, v0) in zip(pool.kv_layers, before, strict=True):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(cache[3], old[1]) and torch.equal(cache[0], old[4])
            for untouched in (1, 2, 4, 5):
                assert torch.equal(cache[untouched], old[untouched])


FP8 = torch.float8_e4m3fn


def test_an_fp8_pool_holds_a_scale_byte_per_vector_and_twice_the_tokens_less_those():
    """kv_fp8's format: head_dim one-byte values and one scale byte per token, layer and head."""
    bf16 = KVCacheShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    fp8 = KVCacheShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype=FP8, block_size=16)
    assert fp8.bytes_per_token() == 2 * 32 * 8 * (128 + 1)
    budget = 1 << 30
    ratio = num_blocks_for_memory(fp8, budget) / num_blocks_for_memory(bf16, budget)
    assert ratio == pytest.approx(256 / 129, rel=0.01)
    pool = PagedKVPool(KVCacheShape(2, 3, 8, FP8, 4), num_blocks=5)
    assert [tuple(s.shape) for pair in pool.kv_scales for s in pair] == [(6, 4, 3)] * 4
    assert all(s.dtype == torch.uint8 for pair in pool.kv_scales for s in pair)
    assert pool.kv_bytes == 6 * pool.shape.bytes_per_block()
    assert [len(layer) for layer in pool.layer_tensors] == [4, 4]


def test_copy_blocks_of_an_fp8_pool_copies_the_scales_with_the_values():
    pool = PagedKVPool(KVCacheShape(2, 3, 8, FP8, 4), num_blocks=5)
    generator = torch.Generator().manual_seed(0)
    for t in (t.view(torch.uint8) for layer in pool.layer_tensors for t in layer):
        t.copy_(torch.randint(0, 256, t.shape, generator=generator, dtype=torch.uint8))
    before = [t.view(torch.uint8).clone() for layer in pool.layer_tensors for t in layer]
    pool.copy_blocks([(1, 3), (4, 0)])
    for old, t in zip(before, (t for layer in pool.layer_tensors for t in layer), strict=True):
        expected = old.clone()
        expected[3], expected[0] = old[1], old[4]
        assert torch.equal(t.view(torch.uint8), expected)


def test_the_int8_store_refuses_an_fp8_pool():
    with pytest.raises(ValueError, match="1 byte an element already"):
        QuantizedKVStore(KVCacheShape(2, 3, 8, FP8, 4), num_slots=2)
