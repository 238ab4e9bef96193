"""rope and qk_norm_rope given a KVStore: q and k as without it, and the cache as if the rotated k
and v had then been copied in token by token (the unfused ops are the oracle)."""

import pytest
import torch

from infer.kernels import KVStore, qk_norm_rope, rope, rope_tables

MAX_POSITIONS = 64
NUM_BLOCKS, BLOCK_SIZE = 7, 5


def make_inputs(tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """Views q, k, v of one q|k|v projection output (the models' layout), positions, the QK norm
    weights, caches of random content and a distinct slot per token."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).mul(2).to(device, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, num_q_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    v = v.view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen).to(device)
    weights = [torch.randn(head_dim, generator=gen).to(device, dtype) for _ in range(2)]
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [torch.randn(cache_shape, generator=gen).to(device, dtype) for _ in range(2)]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    return qkv, q, k, v, positions, weights, caches, slots


def copied_in(cache, rows, slots):
    """The cache after writing row i at flat slot slots[i], one token at a time."""
    cache = cache.clone()
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK_SIZE)
        cache[block, offset] = rows[i]
    return cache


def run(op, q, k, positions, weights, store, head_dim, device):
    cos, sin = rope_tables(head_dim, MAX_POSITIONS, 10000.0, device=device)
    if op == "rope":
        rope(q, k, cos, sin, positions, store=store)
    else:
        qk_norm_rope(q, k, *weights, 1e-6, cos, sin, positions, offset=1.0, store=store)


def check(op, tokens, heads, head_dim, dtype, device):
    qkv, q, k, v, positions, weights, (k_cache, v_cache), slots = make_inputs(
        tokens, *heads, head_dim, dtype, device
    )
    expected_qkv = qkv.clone()
    q_size, kv_size = heads[0] * head_dim, heads[1] * head_dim
    expected_q = expected_qkv[:, :q_size].view_as(q)
    expected_k = expected_qkv[:, q_size : q_size + kv_size].view_as(k)
    run(op, expected_q, expected_k, positions, weights, None, head_dim, device)
    expected_k_cache = copied_in(k_cache, expected_k, slots)
    expected_v_cache = copied_in(v_cache, v, slots)

    run(op, q, k, positions, weights, KVStore(v, k_cache, v_cache, slots), head_dim, device)
    # The same kernel arithmetic with and without the store, and a copy into the cache: bit for bit.
    torch.testing.assert_close(qkv, expected_qkv, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, expected_k_cache, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v_cache, atol=0, rtol=0)


OPS = ["rope", "qk_norm_rope"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, (4, 2), 64), (6, (6, 2), 80), (3, (4, 1), 256)])
def test_interpreted_store_equals_the_unfused_ops(triton_on_cpu, op, tokens, heads, head_dim, dtype):
    check(op, tokens, heads, head_dim, dtype, "cpu")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_store_equals_the_unfused_ops(op, dtype):
    check(op, 5, (6, 2), 64, dtype, "cpu")


def test_interpreted_store_walks_more_kv_heads_than_one_tile(triton_on_cpu):
    # 40 kv heads of 256 exceed one program's head tile: k and v are stored in a loop.
    check("qk_norm_rope", 2, (40, 40), 256, torch.float32, "cpu")
    check("rope", 2, (40, 40), 256, torch.float32, "cpu")


def test_store_is_checked_like_store_kv():
    _, q, k, v, positions, weights, (k_cache, v_cache), slots = make_inputs(3, 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="slot_mapping must be"):
        run("rope", q, k, positions, weights, KVStore(v, k_cache, v_cache, slots[:2]), 64, "cpu")
    with pytest.raises(ValueError, match="v must be"):
        run("qk_norm_rope", q, k, positions, weights, KVStore(v[:, :1], k_cache, v_cache, slots), 64, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "tokens, heads, head_dim", [(1, (32, 8), 64), (1, (16, 8), 128), (1, (4, 1), 256), (30, (32, 8), 128)]
)
def test_cuda_store_equals_the_unfused_ops(cuda, op, tokens, heads, head_dim, dtype):
    check(op, tokens, heads, head_dim, dtype, cuda)
