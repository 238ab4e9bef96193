"""Int8 cold blocks: the round-trip error bound against the original values, the bytes a slot
takes, and the pool running quantize / restore / copy operations in order."""

import pytest
import torch

from infer.cache import COPY, OFFLOAD, RESTORE, KVCacheShape, PagedKVPool, QuantizedKVStore
from infer.cache.kv_quant import dequantize_int8, group_size_for, quantize_int8

SHAPE = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, block_size=4)


def kv_like(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values of many magnitudes, with outliers and an all-zero group, as real K and V have."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator) * torch.logspace(-3, 2, shape[-2]).unsqueeze(-1)
    x[..., 0, 5] = 300.0  # an outlier sets its group's scale
    x[..., 1, :64] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_round_trip_stays_within_one_percent_of_each_groups_largest_value(dtype):
    x = kv_like(3, 8, 128).to(dtype)
    q, scales = quantize_int8(x, 64)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.shape == (3, 8, 2)
    restored = dequantize_int8(q, scales, dtype)
    assert restored.dtype == dtype
    groups = x.float().unflatten(-1, (2, 64))
    error = (restored.float() - x.float()).unflatten(-1, (2, 64)).abs().amax(-1)
    group_max = groups.abs().amax(-1)
    assert torch.all(error <= 0.01 * group_max)
    assert torch.all(restored[..., 1, :64] == 0)  # an all-zero group stays zero


def test_group_size_is_64_or_the_largest_divisor_of_a_small_head():
    assert [group_size_for(d) for d in (64, 128, 256, 16, 80)] == [64, 64, 64, 16, 16]


def test_an_int8_slot_takes_about_half_the_bytes_of_a_bf16_block():
    store = QuantizedKVStore(SHAPE, num_slots=3)
    assert store.nbytes == 3 * QuantizedKVStore.bytes_per_slot(SHAPE)
    assert QuantizedKVStore.bytes_per_slot(SHAPE) / SHAPE.bytes_per_block() == pytest.approx(68 / 128)


def test_a_quantized_block_restores_into_another_block_within_the_bound():
    pool = PagedKVPool(SHAPE, num_blocks=4, store=QuantizedKVStore(SHAPE, 2))
    for layer, (k_cache, v_cache) in enumerate(pool.kv_layers):
        k_cache[1] = kv_like(4, 2, 128, seed=layer)
        v_cache[1] = kv_like(4, 2, 128, seed=10 + layer)
    original = [(k[1].float().clone(), v[1].float().clone()) for k, v in pool.kv_layers]
    pool.run_block_ops([(OFFLOAD, 1, 0)])
    pool.kv_layers[0][0][1].zero_()  # the block goes to a new owner
    pool.run_block_ops([(RESTORE, 0, 3)])
    for (k_cache, v_cache), (k, v) in zip(pool.kv_layers, original, strict=True):
        for restored, before in ((k_cache[3].float(), k), (v_cache[3].float(), v)):
            error = (restored - before).unflatten(-1, (2, 64)).abs().amax(-1)
            assert torch.all(error <= 0.01 * before.unflatten(-1, (2, 64)).abs().amax(-1))


def test_block_ops_run_in_order_when_a_slot_or_block_is_reused_within_a_step():
    pool = PagedKVPool(SHAPE, num_blocks=4, store=QuantizedKVStore(SHAPE, 1))
    k_cache = pool.kv_layers[0][0]
    for block in range(4):
        k_cache[block] = block + 1
    # Slot 0 holds block 0; it is restored into block 1, then takes block 2, which is restored
    # into block 3; then block 3 is copied over block 0. One batch per op would mix them up.
    pool.run_block_ops([(OFFLOAD, 0, 0)])
    pool.run_block_ops([(RESTORE, 0, 1), (OFFLOAD, 2, 0), (RESTORE, 0, 3), (COPY, 3, 0)])
    assert [k_cache[block].float().mean().item() for block in range(4)] == [3, 1, 3, 3]
    # Copies of one kind in a row: the second reads what the first wrote.
    k_cache[0] = 7
    pool.run_block_ops([(COPY, 0, 1), (COPY, 1, 2)])
    assert [k_cache[block].float().mean().item() for block in range(4)] == [7, 7, 7, 3]


def test_int8_ops_on_a_pool_without_slots_are_refused():
    pool = PagedKVPool(SHAPE, num_blocks=2)
    with pytest.raises(ValueError, match="a pool with a store"):
        pool.run_block_ops([(OFFLOAD, 0, 0)])


@pytest.mark.gpu
def test_on_cuda_a_bf16_block_round_trips_within_the_bound():
    shape = KVCacheShape(num_layers=1, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16, block_size=16)
    pool = PagedKVPool(shape, num_blocks=4, device="cuda", store=QuantizedKVStore(shape, 2, "cuda"))
    k_cache, v_cache = pool.kv_layers[0]
    k_cache[2] = kv_like(16, 8, 64).to("cuda", torch.bfloat16)
    v_cache[2] = kv_like(16, 8, 64, seed=1).to("cuda", torch.bfloat16)
    before = [k_cache[2].float().clone(), v_cache[2].float().clone()]
    pool.run_block_ops([(OFFLOAD, 2, 1), (RESTORE, 1, 0)])
    for cache, original in zip((k_cache, v_cache), before, strict=True):
        error = (cache[0].float() - original).abs().amax(-1)
        assert torch.all(error <= 0.01 * original.abs().amax(-1))
