"""store_kv against a per-token copy loop, and the kernel against the reference."""

import pytest
import torch

from infer.kernels import store_kv, store_kv_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (kv heads, head_dim): Llama 3.2 1B, Gemma 3 1B, a head count and head_dim not powers of two.
KV_SHAPES = [(8, 64), (1, 256), (3, 80)]


def make_inputs(num_tokens, kv_shape, dtype, device, seed, *, num_blocks=6, block_size=5, fused_kv=False):
    """k, v [N, H, D] (views into one [N, 2, H, D] tensor if fused_kv), caches, distinct slots."""
    num_heads, head_dim = kv_shape
    gen = torch.Generator().manual_seed(seed)
    if fused_kv:  # strided over the token dim, as views of a fused projection output are
        kv = torch.randn(num_tokens, 2, num_heads, head_dim, generator=gen).to(device, dtype)
        k, v = kv[:, 0], kv[:, 1]
    else:
        k = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=gen).to(device, dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    return k, v, k_cache, v_cache, slot_mapping


def copy_loop(k, v, k_cache, v_cache, slot_mapping):
    """Token by token, straight from the definition: the slot's row of the flat cache is the token."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, k_cache.shape[1])
        k_cache[block, offset] = k[i]
        v_cache[block, offset] = v[i]
    return k_cache, v_cache


def check_store(num_tokens, kv_shape, dtype, device, seed, **kwargs):
    k, v, k_cache, v_cache, slot_mapping = make_inputs(num_tokens, kv_shape, dtype, device, seed, **kwargs)
    expected_k, expected_v = copy_loop(k, v, k_cache, v_cache, slot_mapping)
    assert store_kv(k, v, k_cache, v_cache, slot_mapping) is None
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)  # a copy: bit for bit
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


@pytest.mark.parametrize("fused_kv", [False, True])
def test_reference_equals_the_copy_loop(fused_kv):
    k, v, k_cache, v_cache, slot_mapping = make_inputs(7, (3, 80), torch.float32, "cpu", 0, fused_kv=fused_kv)
    expected_k, expected_v = copy_loop(k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("kv_shape", KV_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused_kv", [False, True])
def test_kernel_interpreted_matches_the_copy_loop(triton_on_cpu, kv_shape, dtype, fused_kv):
    check_store(9, kv_shape, dtype, "cpu", seed=1, fused_kv=fused_kv)


def test_kernel_interpreted_takes_int32_slots_and_no_tokens(triton_on_cpu):
    k, v, k_cache, v_cache, slot_mapping = make_inputs(4, (2, 64), torch.float16, "cpu", seed=2)
    expected_k, expected_v = copy_loop(k, v, k_cache, v_cache, slot_mapping)
    store_kv(k, v, k_cache, v_cache, slot_mapping.int())
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    store_kv(k[:0], v[:0], k_cache, v_cache, slot_mapping[:0])
    assert torch.equal(k_cache, expected_k)


def test_rejects_mismatched_inputs():
    k, v, k_cache, v_cache, slot_mapping = make_inputs(3, (2, 64), torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="k must have the cache's dtype"):
        store_kv(k.half(), v, k_cache, v_cache, slot_mapping)
    with pytest.raises(ValueError, match="v must be"):
        store_kv(k, v[..., :32], k_cache, v_cache, slot_mapping)
    with pytest.raises(ValueError, match="k_cache and v_cache must both be"):
        store_kv(k, v, k_cache, v_cache[:1], slot_mapping)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(k, v, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, v, k_cache, v_cache, slot_mapping.float())
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, v, k_cache, v_cache, slot_mapping[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_shape", KV_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused_kv", [False, True])
def test_kernel_cuda_matches_the_copy_loop(cuda, kv_shape, dtype, fused_kv):
    check_store(300, kv_shape, dtype, cuda, seed=3, num_blocks=40, block_size=16, fused_kv=fused_kv)


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph_follows_new_slots(cuda):
    k, v, k_cache, v_cache, slot_mapping = make_inputs(
        8, (8, 64), torch.bfloat16, cuda, seed=4, num_blocks=20
    )
    store_kv(k, v, k_cache, v_cache, slot_mapping)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k, v, k_cache, v_cache, slot_mapping)
    for seed in range(3):
        new_k, new_v, _, _, new_slots = make_inputs(
            8, (8, 64), torch.bfloat16, cuda, 10 + seed, num_blocks=20
        )
        k.copy_(new_k)
        v.copy_(new_v)
        slot_mapping.copy_(new_slots)
        expected_k, expected_v = copy_loop(k, v, k_cache, v_cache, slot_mapping)
        graph.replay()
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
