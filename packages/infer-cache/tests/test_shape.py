"""KVCacheShape: one token's KV is 2 (K and V) * layers * kv_heads * head_dim elements of dtype."""

import pytest
import torch

from infer.cache import KVCacheShape

# Hand-computed from the definition, not from the code under test.
SMOLLM2_LIKE = KVCacheShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, block_size=16)
# 2 * 30 * 3 * 64 * 2 bytes = 23,040 bytes per token; * 16 = 368,640 bytes per block.
GEMMA3_LIKE = KVCacheShape(num_layers=18, num_kv_heads=1, head_dim=256, dtype=torch.float32, block_size=32)
# 2 * 18 * 1 * 256 * 4 bytes = 36,864 bytes per token; * 32 = 1,179,648 bytes per block.


@pytest.mark.parametrize(
    ("shape", "per_token", "per_block"),
    [(SMOLLM2_LIKE, 23_040, 368_640), (GEMMA3_LIKE, 36_864, 1_179_648)],
    ids=["smollm2", "gemma3"],
)
def test_bytes_match_a_hand_computation(shape, per_token, per_block):
    assert shape.bytes_per_token() == per_token
    assert shape.bytes_per_block() == per_block
    assert shape.kv_bytes(100) == 100 * per_token
    assert shape.kv_bytes(0) == 0


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (256, 16)])
def test_blocks_for_tokens_rounds_up(num_tokens, blocks):
    assert SMOLLM2_LIKE.blocks_for_tokens(num_tokens) == blocks


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_dimensions_must_be_positive(field):
    dims = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, block_size=4)
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        KVCacheShape(**{**dims, field: 0})


def test_dtype_must_be_a_torch_dtype():
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_size=4)


def test_negative_token_counts_are_refused():
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        SMOLLM2_LIKE.blocks_for_tokens(-1)
    with pytest.raises(ValueError, match="num_tokens must be an integer"):
        SMOLLM2_LIKE.kv_bytes(1.5)
