"""The memory a pool takes is 2 (K and V) * layers * kv_heads * head_dim * tokens * dtype bytes."""

import pytest
import torch

from infer.cache import ContiguousKVCache, KVCacheShape, SlottedKVCache

SHAPES = [
    # SmolLM2-135M-like and Gemma-3-270M-like geometry, shortened sequences to stay small.
    KVCacheShape(num_layers=30, num_kv_heads=3, head_dim=64, max_seq_len=16, dtype=torch.bfloat16),
    KVCacheShape(num_layers=18, num_kv_heads=1, head_dim=256, max_seq_len=8, dtype=torch.float32),
    KVCacheShape(num_layers=1, num_kv_heads=2, head_dim=8, max_seq_len=5, dtype=torch.float16),
]
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def formula_bytes(shape: KVCacheShape, num_tokens: int) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * num_tokens * DTYPE_BYTES[shape.dtype]


def storage_bytes(kv_layers) -> int:
    # Measured from the tensors' storage, independent of the pools' own kv_bytes arithmetic.
    return sum(t.untyped_storage().nbytes() for layer in kv_layers for t in layer)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s.num_layers}-H{s.num_kv_heads}-{s.dtype}")
@pytest.mark.parametrize("pool_type", [ContiguousKVCache, SlottedKVCache])
def test_kv_bytes_equals_the_formula(shape, pool_type):
    num_slots = 3
    pool = pool_type(shape, num_slots=num_slots)
    expected = formula_bytes(shape, num_slots * shape.max_seq_len)
    assert storage_bytes(pool.kv_layers) == expected
    assert pool.kv_bytes == expected
    assert shape.kv_bytes(num_slots * shape.max_seq_len) == expected
