"""decode_attention against a per-row, per-head loop in float64, and the kernel against the reference."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import assert_close, decode_attention, decode_attention_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (q heads, kv heads, head_dim): Llama 3.2 1B, Qwen3, Gemma 3 1B (one KV head, dim 256), SmolLM2
# (3:1 groups, dim 64), and a head_dim that is not a power of two.
HEAD_SHAPES = [(32, 8, 64), (16, 8, 128), (4, 1, 256), (9, 3, 64), (4, 2, 80)]


def make_inputs(batch, heads, max_len, dtype, device, seed, num_slots=None):
    num_q_heads, num_kv_heads, head_dim = heads
    num_slots = num_slots or batch + 2
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen).to(device, dtype)
    k_cache = torch.randn(num_slots, num_kv_heads, max_len, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, max_len, head_dim, generator=gen).to(device, dtype)
    slot_ids = torch.randperm(num_slots, generator=gen)[:batch].to(device)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen).to(device)
    seq_lens[0] = max_len  # one row reads the whole slot
    return q, k_cache, v_cache, slot_ids, seq_lens


def brute_force(q, k_cache, v_cache, slot_ids, seq_lens, scale, sliding_window=None):
    """Row by row, head by head, in float64: softmax(q . K^T * scale) V over the visible keys."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        end = int(seq_lens[b])
        begin = max(0, end - sliding_window) if sliding_window else 0
        for h in range(q.shape[1]):
            keys = k_cache[int(slot_ids[b]), h // group, begin:end].double().cpu()
            values = v_cache[int(slot_ids[b]), h // group, begin:end].double().cpu()
            weights = torch.softmax(keys @ q[b, h].double().cpu() * scale, dim=0)
            out[b, h] = weights @ values
    return out


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_reference_equals_the_brute_force_loop(heads, sliding_window):
    inputs = make_inputs(4, heads, 37, torch.float32, "cpu", seed=1)
    scale = 1 / math.sqrt(heads[2])
    out = decode_attention_ref(*inputs, scale=scale, sliding_window=sliding_window)
    torch.testing.assert_close(
        out.double(), brute_force(*inputs, scale, sliding_window), atol=1e-5, rtol=1e-5
    )


def check_kernel(batch, heads, max_len, dtype, device, seed, sliding_window=None):
    inputs = make_inputs(batch, heads, max_len, dtype, device, seed)
    scale = 1 / math.sqrt(heads[2])
    out = decode_attention(*inputs, scale=scale, sliding_window=sliding_window)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert_close(out, decode_attention_ref(*inputs, scale=scale, sliding_window=sliding_window))


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_interpreted_matches_reference(triton_on_cpu, heads, dtype):
    # 70 keys: two blocks of 64 (or three of 32), the last one ragged.
    check_kernel(3, heads, 70, dtype, "cpu", seed=2)


@pytest.mark.parametrize("sliding_window", [1, 7, 64, 65])
def test_kernel_interpreted_sliding_window(triton_on_cpu, sliding_window):
    check_kernel(3, (4, 1, 64), 150, torch.float32, "cpu", seed=3, sliding_window=sliding_window)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 4),
    heads=st.sampled_from(HEAD_SHAPES),
    max_len=st.integers(1, 130),
    sliding_window=st.sampled_from([None, 1, 16, 100]),
    seed=st.integers(0, 2**16),
)
def test_kernel_interpreted_any_lengths(triton_on_cpu, batch, heads, max_len, sliding_window, seed):
    check_kernel(batch, heads, max_len, torch.float32, "cpu", seed, sliding_window)


def test_rejects_mismatched_inputs():
    q, k_cache, v_cache, slot_ids, seq_lens = make_inputs(2, (4, 2, 64), 8, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q.half(), k_cache, v_cache, slot_ids, seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(q[..., :32], k_cache, v_cache, slot_ids, seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q, k_cache, v_cache, slot_ids, seq_lens.float(), scale=1.0)
    with pytest.raises(ValueError, match="slot_ids"):
        decode_attention(q, k_cache, v_cache, slot_ids[:1], seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scale=1.0, sliding_window=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 512])
def test_kernel_cuda_matches_reference(cuda, heads, dtype, sliding_window):
    check_kernel(16, heads, 1500, dtype, cuda, seed=4, sliding_window=sliding_window)


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph_follows_new_lengths_and_slots(cuda):
    q, k_cache, v_cache, slot_ids, seq_lens = make_inputs(8, (32, 8, 64), 600, torch.bfloat16, cuda, seed=5)
    out = decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scale=0.125)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scale=0.125)
    for seed in range(3):
        _, _, _, new_slots, new_lens = make_inputs(8, (32, 8, 64), 600, torch.bfloat16, cuda, seed=10 + seed)
        slot_ids.copy_(new_slots)
        seq_lens.copy_(new_lens)
        graph.replay()
        expected = decode_attention_ref(q, k_cache, v_cache, slot_ids, seq_lens, scale=0.125)
        assert_close(out, expected)
