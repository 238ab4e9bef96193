"""The fp8 KV cache: kv_fp8's format against its definition, store_kv's fp8 writes against the
reference, and paged attention over fp8 caches against the reference and a brute-force loop."""

import importlib
import math

import numpy as np
import pytest
import torch

from infer.kernels import assert_close, paged_attention, paged_attention_ref, store_kv, store_kv_ref
from infer.kernels.kv_fp8 import FP8_DTYPE, dequantize_fp8_ref, quantize_fp8_ref

from .test_paged_attention import brute_force, make_batch

# The module that launches the kernels (infer.kernels exports a function under the package's name).
launch_module = importlib.import_module("infer.kernels.paged_attention.launch")


def vectors(seed: int, shape=(64, 4, 128)) -> torch.Tensor:
    """Vectors of very different magnitudes (1e-6 to 1e4 across vectors), with outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x *= 10.0 ** torch.empty(shape[:-1], dtype=torch.float32).uniform_(-6, 4, generator=gen).unsqueeze(-1)
    x[..., 0] *= 30  # one outlier per vector
    x[0] = 0.0  # all-zero vectors
    return x


def test_the_scale_is_the_least_power_of_two_that_fits_448():
    x = vectors(0)
    _, scale_bytes = quantize_fp8_ref(x)
    for vector, byte in zip(x.view(-1, x.shape[-1]), scale_bytes.view(-1).tolist(), strict=True):
        wanted = float(np.float32(vector.abs().max().item()) * np.float32(1 / 448))
        expected = 1 if wanted == 0 else min(max(math.ceil(math.log2(wanted)) + 127, 1), 253)
        assert byte == expected


def test_a_round_trip_is_within_a_sixteenth_of_each_element():
    x = vectors(1)
    q, scale_bytes = quantize_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and scale_bytes.dtype == torch.uint8
    restored = dequantize_fp8_ref(q, scale_bytes, torch.float32)
    scales = torch.pow(2.0, scale_bytes.double() - 127).unsqueeze(-1)
    # e4m3 rounds a normal value to 3 mantissa bits (half an ulp: 1/16 of it); below its
    # smallest normal (2**-6 of the scale) the step is 2**-9 of the scale.
    bound = torch.maximum(x.double().abs() / 16, scales * 2.0**-10)
    assert ((restored.double() - x.double()).abs() <= bound).all()
    assert (restored[0] == 0).all()
    # The largest element of each vector maps into (224, 448]: the whole range is used.
    largest = (x.abs().amax(-1) / scales.squeeze(-1).float())[1:]
    assert (largest > 224).all() and (largest <= 448).all()


def fp8_cache(k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16/fp32 cache as kv_fp8 stores it: (values, scale bytes)."""
    return quantize_fp8_ref(k_cache)


def test_store_kv_ref_writes_the_format_at_each_slot():
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    k_cache = torch.zeros(3, 4, 2, 64, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k_scales = torch.zeros(3, 4, 2, dtype=torch.uint8)
    v_scales = torch.zeros_like(k_scales)
    slots = torch.tensor([11, 0, 5, 6, 2])
    store_kv(k, v, k_cache, v_cache, slots, k_scales=k_scales, v_scales=v_scales)
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        values, scale_bytes = quantize_fp8_ref(x)
        flat = cache.view(torch.uint8).view(-1, 2, 64)
        assert torch.equal(flat[slots], values.view(torch.uint8))
        assert torch.equal(scales.view(-1, 2)[slots], scale_bytes)
        untouched = [s for s in range(12) if s not in slots.tolist()]
        assert (flat[untouched] == 0).all()


def test_store_kv_refuses_an_fp8_cache_without_scales_and_scales_without_one():
    k = torch.randn(1, 2, 64)
    fp8 = torch.zeros(3, 4, 2, 64, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="needs k_scales"):
        store_kv(k, k, fp8, fp8.clone(), torch.tensor([0]))
    scales = torch.zeros(3, 4, 2, dtype=torch.uint8)
    plain = torch.zeros(3, 4, 2, 64)
    with pytest.raises(ValueError, match="are for float8_e4m3fn caches"):
        store_kv(k, k, plain, plain.clone(), torch.tensor([0]), k_scales=scales, v_scales=scales)


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_the_reference_attends_over_the_dequantized_cache(sliding_window):
    q, k_cache, v_cache, kwargs = make_batch(
        [5, 1, 40], [(7, 19), (1, 30)], (4, 2, 64), 3, torch.float32, "cpu", 3
    )
    (k8, ks), (v8, vs) = fp8_cache(k_cache), fp8_cache(v_cache)
    out = paged_attention(q, k8, v8, k_scales=ks, v_scales=vs, sliding_window=sliding_window, **kwargs)
    k_deq, v_deq = dequantize_fp8_ref(k8, ks, torch.float32), dequantize_fp8_ref(v8, vs, torch.float32)
    expected = brute_force(q, k_deq, v_deq, sliding_window=sliding_window, **kwargs)
    assert_close(out, expected.float())


def check_fp8_kernel(decode, extend, heads, block_size, dtype, device, seed, sliding_window=None):
    q, k_cache, v_cache, kwargs = make_batch(decode, extend, heads, block_size, dtype, device, seed)
    (k8, ks), (v8, vs) = fp8_cache(k_cache), fp8_cache(v_cache)
    out = paged_attention(q, k8, v8, k_scales=ks, v_scales=vs, sliding_window=sliding_window, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    expected = paged_attention_ref(
        q, k8, v8, k_scales=ks, v_scales=vs, sliding_window=sliding_window, **kwargs
    )
    assert_close(out, expected)


def check_fp8_store(num_tokens, heads, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = heads
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    k[0] = 0.0
    slots = torch.randperm(num_tokens * 2, generator=gen)[:num_tokens].to(device)
    caches = []
    for _ in range(2):
        cache = torch.zeros(num_tokens // 8 + 1, 16, num_kv_heads, head_dim, dtype=FP8_DTYPE, device=device)
        scales = torch.zeros(cache.shape[:3], dtype=torch.uint8, device=device)
        caches.append([cache, cache.clone(), scales, scales.clone()])
    (kc, vc, ks, vs), (kc_ref, vc_ref, ks_ref, vs_ref) = caches
    store_kv(k, v, kc, vc, slots, k_scales=ks, v_scales=vs)
    store_kv_ref(k, v, kc_ref, vc_ref, slots, k_scales=ks_ref, v_scales=vs_ref)
    for got, want in ((kc, kc_ref), (vc, vc_ref), (ks, ks_ref), (vs, vs_ref)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit


# No interpreted store: Triton's interpreter rounds float32 to e4m3 wrongly where rounding up
# carries into the exponent (-124 becomes -64, not -128); the GPU test below checks the store.
def test_kernel_interpreted_fp8_attention(triton_on_cpu):
    check_fp8_kernel([70, 1, 130], [(40, 140), (17, 17)], (4, 2, 64), 16, torch.float32, "cpu", seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 128), (1, 256), (3, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_cuda_fp8_store_is_the_reference_bit_for_bit(cuda, heads, dtype):
    check_fp8_store(1000, heads, dtype, cuda, seed=6)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8, 64), (16, 8, 128), (4, 1, 256), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 512])
@pytest.mark.parametrize("block_size", [16, None])
@pytest.mark.parametrize("f16_dots", [False, True], ids=["native-dots", "f16-dots"])
def test_kernel_cuda_fp8_mixed_batch(cuda, heads, dtype, sliding_window, block_size, f16_dots, monkeypatch):
    monkeypatch.setattr(launch_module, "_FP8_F16_DOTS", f16_dots)
    decode = [1500, 1, 700, 257, 1024, 33]
    extend = [(300, 1500), (1000, 1000), (1, 64)]
    check_fp8_kernel(decode, extend, heads, block_size, dtype, cuda, seed=7, sliding_window=sliding_window)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_cuda_fp8_in_a_cuda_graph_follows_new_lengths(cuda, pdl):
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    decode = [1024, 5, 600, 300, 129, 1000, 64, 17]
    q, k_cache, v_cache, kwargs = make_batch(decode, [], (32, 8, 128), 16, torch.bfloat16, cuda, 8)
    (k8, ks), (v8, vs) = fp8_cache(k_cache), fp8_cache(v_cache)
    paged_attention(q, k8, v8, k_scales=ks, v_scales=vs, pdl=pdl, **kwargs)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k8, v8, k_scales=ks, v_scales=vs, pdl=pdl, **kwargs)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        kwargs["seq_lens"].copy_(torch.randint(1, 1025, (len(decode),), generator=gen, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen))
        graph.replay()
        assert_close(out, paged_attention_ref(q, k8, v8, k_scales=ks, v_scales=vs, **kwargs))
