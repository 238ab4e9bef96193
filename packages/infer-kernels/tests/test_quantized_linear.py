"""quantized_linear against quantized_linear_ref; dequantize_weight against a per-element loop.

Tolerance. The kernel and the reference compute the same exact products (an int8 or e4m3 weight
times x, exact in fp32), add the same K of them in fp32 in different orders, and round once to
x's dtype. Inputs are scaled so that outputs are of order 1 (x ~ N(0, 1), weights ~ 1/sqrt(K)).
- bf16 / fp16 outputs: the two fp32 sums differ by about sqrt(K) * 2^-24 of the terms' magnitude,
  under 1e-5 even at K = 12288, far below one ulp of the output (2^-8 bf16, 2^-11 fp16); rounding
  can still land the two on neighbouring values, which the table's two-ulp rtol (and its atol
  near zero) covers: `infer.kernels.assert_close` as for every op.
- fp32 outputs: there is no output rounding to hide behind, so the bound is the summation error
  itself: each of the K additions errs by at most 2^-24 of its running sum, which is at most
  sum_k |x_k W_nk|; with random signs the errors add up like a random walk, about sqrt(K) of
  them. `assert_matches_reference` allows 4 * sqrt(K) * 2^-24 * (|x| @ |W|.T) per element (plus
  1e-6 for the bias add and the final scale multiply), which for K = 12288 is about 1e-5 of the
  magnitude where the table's fp32 row would be a coin toss.
"""

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    assert_close,
    assert_gated_close,
    dequantize_weight,
    quantized_gated_gemv,
    quantized_gated_gemv_ref,
    quantized_linear,
    quantized_linear_ref,
)
from infer.kernels.gemv.quantized import _launch

WEIGHT_DTYPES = [torch.int8, torch.float8_e4m3fn]
# The scale layouts: one per output channel (int8 checkpoints), 128 x 128 blocks (fp8
# checkpoints), 1 x 128 (what the loader makes of fused q/k/v with partial 128-row blocks).
BLOCKS = ["channel", "128x128", "1x128"]
# Sizes that are not multiples of 128 (partial last blocks, masked tiles) and ones that are.
SMALL_SIZES = [64, 130, 192, 200, 256, 576]
# (N, K) of the target models' projections: Qwen3-8B qkv, o, gate_up, down; Llama-3.2-3B the same.
MODEL_SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (24576, 4096),
    (4096, 12288),
    (5120, 3072),
    (3072, 3072),
    (16384, 3072),
    (3072, 8192),
]
GPU_TOKENS = [1, 2, 4, 8, 16, 256, 2048]


def block_size(block: str, K: int) -> tuple[int, int]:
    return {"channel": (1, K), "128x128": (128, 128), "1x128": (1, 128)}[block]


def make_weight(N, K, weight_dtype, block_size, device, seed=0):
    """An [N, K] 8-bit weight and float32 scales such that W = weight * scale has |W| ~ 1/sqrt(K)."""
    gen = torch.Generator(device).manual_seed(seed)
    if weight_dtype == torch.int8:
        weight = torch.randint(-127, 128, (N, K), generator=gen, device=device, dtype=torch.int8)
        magnitude = 127.0
    else:
        # e4m3 values spread over most of the format's exponents (max 448).
        weight = (64 * torch.randn(N, K, generator=gen, device=device)).clamp(-448, 448).to(weight_dtype)
        magnitude = 64.0
    bn, bk = block_size
    scale_shape = (math.ceil(N / bn), math.ceil(K / bk))
    scale = (0.5 + torch.rand(scale_shape, generator=gen, device=device)) / (magnitude * math.sqrt(K))
    return weight, scale


def make_x(M, K, x_dtype, device, seed=1):
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(M, K, generator=gen, device=device).to(x_dtype)


def make_bias(N, x_dtype, device, seed=2):
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(N, generator=gen, device=device).to(x_dtype)


def assert_matches_reference(out, x, weight, scale, block_size, bias=None):
    expected = quantized_linear_ref(x, weight, scale, block_size, bias)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if expected.dtype != torch.float32:
        assert_close(out, expected)
        return
    bound = sum_error_bound(x, weight, scale, block_size).reshape(out.shape)
    error = (out - expected).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), (
        f"fp32 error {error.flatten()[worst].item():.3g} above its bound {bound.flatten()[worst].item():.3g}"
    )


def sum_error_bound(x, weight, scale, block_size, bias=None):
    """fp32 outputs: the summation-order bound of the module docstring, per output."""
    K = weight.shape[1]
    w = dequantize_weight(weight, scale, block_size, torch.float32)
    magnitude = x.float().abs().reshape(-1, K) @ w.abs().T
    if bias is not None:
        magnitude += bias.float().abs()
    return 1e-6 + 4 * math.sqrt(K) * 2.0**-24 * magnitude


def check_gated(N, K, weight_dtype, block, x_dtype, with_bias, activation, device):
    """quantized_gated_gemv of a [2N, K] gate/up weight against the unfused reference."""
    bs = block_size(block, K)
    weight, scale = make_weight(2 * N, K, weight_dtype, bs, device)
    x = make_x(1, K, x_dtype, device)
    bias = make_bias(2 * N, x_dtype, device) if with_bias else None
    out = quantized_gated_gemv(x, weight, scale, bs, bias, activation=activation)
    expected = quantized_gated_gemv_ref(x, weight, scale, bs, bias, activation=activation)
    gate_up = quantized_linear_ref(x, weight, scale, bs, bias)
    error = sum_error_bound(x, weight, scale, bs, bias) if x_dtype == torch.float32 else None
    assert_gated_close(out, expected, gate_up, activation, error)


def check(M, N, K, weight_dtype, block, x_dtype, with_bias, device, **launch):
    bs = block_size(block, K)
    weight, scale = make_weight(N, K, weight_dtype, bs, device)
    x = make_x(M, K, x_dtype, device)
    bias = make_bias(N, x_dtype, device) if with_bias else None
    if launch:
        out = _launch(x, weight, scale, bs, bias, **launch)
    else:
        out = quantized_linear(x, weight, scale, bs, bias)
    assert_matches_reference(out, x, weight, scale, bs, bias)


# -- the Triton kernels through the interpreter -------------------------------------------------


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 20),
    N=st.sampled_from(SMALL_SIZES),
    K=st.sampled_from(SMALL_SIZES),
    weight_dtype=st.sampled_from(WEIGHT_DTYPES),
    block=st.sampled_from(BLOCKS),
    x_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
)
def test_interpreted_matches_reference(triton_on_cpu, tokens, N, K, weight_dtype, block, x_dtype, with_bias):
    check(tokens, N, K, weight_dtype, block, x_dtype, with_bias, "cpu")


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_interpreted_each_kernel_and_split(triton_on_cpu, kernel, weight_dtype, block, split_k):
    """Both kernels, with and without split-K (its partial sums and their reduction), whatever the
    choice by shape would be. K = 520: four 128-column blocks and a partial fifth."""
    check(3, 130, 520, weight_dtype, block, torch.bfloat16, True, "cpu", kernel=kernel, split_k=split_k)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("bs", [(2, 64), (64, 256), (1, 512), (5, 48), (3, 40)])
def test_interpreted_other_block_sizes(triton_on_cpu, bs, tokens):
    """Any (bn, bk): K tiles are the largest power of two dividing bk (16 at least for the
    tensor-core kernel, else the FMA kernel takes the call), so none straddles two blocks."""
    weight_dtype = torch.float8_e4m3fn if tokens == 1 else torch.int8
    weight, scale = make_weight(130, 600, weight_dtype, bs, "cpu")
    x = make_x(tokens, 600, torch.bfloat16, "cpu")
    assert_matches_reference(quantized_linear(x, weight, scale, bs), x, weight, scale, bs)


@pytest.mark.parametrize("block_k", [256, 512])
@pytest.mark.parametrize("split_k", [1, 3])
def test_interpreted_fp8_tiles_across_scale_blocks(triton_on_cpu, block_k, split_k):
    """A GEMV tile of 16 rows inside a 128 x 128 scale block may span several 128-column blocks
    (and a partial last one, K = 600): x's columns each take their own block's scale."""
    config = dict(BLOCK_N=16, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1)
    launch = dict(kernel="gemv", config=config, split_k=split_k)
    check(1, 130, 600, torch.float8_e4m3fn, "128x128", torch.bfloat16, True, "cpu", **launch)


@pytest.mark.parametrize("fold", [4, 16])
@pytest.mark.parametrize(
    "weight_dtype, block, block_k",
    [
        (torch.int8, "channel", 256),
        (torch.float8_e4m3fn, "128x128", 256),
        (torch.float8_e4m3fn, "1x128", 128),
    ],
)
def test_interpreted_gemv_folds_adjacent_products(triton_on_cpu, weight_dtype, block, block_k, fold):
    """FOLD: each run of `fold` adjacent products of a row is summed before it joins the
    accumulator (K = 600: a partial last tile, masked to zeros), with and without split-K."""
    config = dict(BLOCK_N=8, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1, FOLD=fold)
    for split_k in (1, 3):
        launch = dict(kernel="gemv", config=config, split_k=split_k)
        check(1, 130, 600, weight_dtype, block, torch.bfloat16, True, "cpu", **launch)


@pytest.mark.parametrize("N", [130, 256])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_interpreted_gated_matches_the_unfused_pair(triton_on_cpu, weight_dtype, block, N):
    """The gate/up projection with its activation in one kernel: up rows N past their gate rows,
    with scales of their own. N = 256 lines the up rows' 8-row tiles up with 128-row scale
    blocks, so tiles span 128-column blocks; N = 130 does not, and tiles keep to one."""
    for x_dtype, with_bias, activation in [
        (torch.bfloat16, True, "silu"),
        (torch.float32, False, "gelu_tanh"),
    ]:
        check_gated(N, 600, weight_dtype, block, x_dtype, with_bias, activation, "cpu")


def test_gated_cpu_path_is_the_unfused_pair():
    weight, scale = make_weight(260, 192, torch.int8, (1, 192), "cpu")
    x, bias = make_x(1, 192, torch.bfloat16, "cpu"), make_bias(260, torch.bfloat16, "cpu")
    out = quantized_gated_gemv(x, weight, scale, (1, 192), bias, activation="silu")
    gate, up = quantized_linear_ref(x, weight, scale, (1, 192), bias).float().chunk(2, dim=-1)
    assert torch.equal(out, (torch.nn.functional.silu(gate) * up).to(torch.bfloat16))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=torch.randn(2, 256)), "x must be one row of K = 256"),
        (dict(activation="relu"), "activation must be one of"),
        (
            dict(weight=torch.zeros(131, 256, dtype=torch.int8), scale=torch.ones(131, 1)),
            "even number of rows",
        ),
    ],
)
@pytest.mark.parametrize("op", [quantized_gated_gemv, quantized_gated_gemv_ref])
def test_gated_rejects_bad_inputs(op, change, message):
    valid = dict(
        x=torch.randn(1, 256),
        weight=torch.zeros(130, 256, dtype=torch.int8),
        scale=torch.ones(130, 1),
        block_size=(1, 256),
        activation="silu",
    )
    with pytest.raises(ValueError, match=message):
        op(**(valid | change))


def test_a_tile_across_row_scales_is_refused():
    """Where the tile's rows have scales of their own ((1, 128)), a tile must stay in one block."""
    weight, scale = make_weight(32, 512, torch.float8_e4m3fn, (1, 128), "cpu")
    config = dict(BLOCK_N=16, BLOCK_K=256, UNROLL=1, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="straddles scale blocks of 128 columns"):
        _launch(torch.randn(1, 512), weight, scale, (1, 128), None, kernel="gemv", config=config)


def test_a_fold_that_does_not_divide_the_tile_is_refused():
    weight, scale = make_weight(32, 512, torch.int8, (1, 512), "cpu")
    config = dict(BLOCK_N=8, BLOCK_K=128, UNROLL=1, num_warps=4, num_stages=1, FOLD=48)
    with pytest.raises(ValueError, match="FOLD 48 does not divide BLOCK_K 128"):
        _launch(torch.randn(1, 512), weight, scale, (1, 512), None, kernel="gemv", config=config)


def test_interpreted_keeps_leading_dims_and_reads_strided_x(triton_on_cpu):
    weight, scale = make_weight(192, 256, torch.int8, (128, 128), "cpu")
    x = torch.randn(2, 3, 256)
    out = quantized_linear(x, weight, scale, (128, 128))
    assert out.shape == (2, 3, 192)
    assert_matches_reference(out, x, weight, scale, (128, 128))
    every_other_token = x[:, ::2]
    columns = torch.randn(256, 4).T  # rows 1 apart, columns 4 apart: copied to a unit column stride
    for strided in (every_other_token, columns):
        out = quantized_linear(strided, weight, scale, (128, 128))
        assert_matches_reference(out, strided, weight, scale, (128, 128))


# -- the compiled kernels on a GPU ----------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def cached_weight(N, K, weight_dtype, block):
    return make_weight(N, K, weight_dtype, block_size(block, K), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("weight_dtype, block", [(torch.int8, "channel"), (torch.float8_e4m3fn, "128x128")])
@pytest.mark.parametrize("N, K", MODEL_SHAPES)
def test_cuda_model_shapes_match_reference(cuda, N, K, weight_dtype, block, tokens):
    bs = block_size(block, K)
    weight, scale = cached_weight(N, K, weight_dtype, block)
    x = make_x(tokens, K, torch.bfloat16, cuda)
    assert_matches_reference(quantized_linear(x, weight, scale, bs), x, weight, scale, bs)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 33, 300])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("N, K", [(200, 130), (1024, 4096)])
def test_cuda_layouts_and_ragged_shapes(cuda, N, K, weight_dtype, block, tokens):
    check(tokens, N, K, weight_dtype, block, torch.bfloat16, tokens % 2 == 1, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("weight_dtype, block", [(torch.int8, "channel"), (torch.float8_e4m3fn, "128x128")])
def test_cuda_fp16_and_fp32_x(cuda, weight_dtype, block, x_dtype, tokens):
    check(tokens, 576, 1000, weight_dtype, block, x_dtype, True, cuda)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_interpreted_dequantize_then_matmul(triton_on_cpu, weight_dtype, block):
    """The prefill path: the weight dequantized to x's dtype in one pass, then F.linear."""
    check(3, 130, 520, weight_dtype, block, torch.bfloat16, True, "cpu", kernel="dequantize")
    check(2, 200, 192, weight_dtype, block, torch.float32, False, "cpu", kernel="dequantize")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 2048])
@pytest.mark.parametrize(("N", "K"), MODEL_SHAPES[:4])
@pytest.mark.parametrize(
    ("weight_dtype", "block"), [(torch.int8, "channel"), (torch.float8_e4m3fn, "128x128")]
)
def test_cuda_dequantize_then_matmul(cuda, N, K, weight_dtype, block, tokens):
    check(tokens, N, K, weight_dtype, block, torch.bfloat16, True, cuda, kernel="dequantize")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("weight_dtype, block", [(torch.int8, "channel"), (torch.float8_e4m3fn, "128x128")])
@pytest.mark.parametrize("N, K", [(12288, 4096), (8192, 3072), (6912, 1152), (200, 1000)])
def test_cuda_gated_matches_the_unfused_pair(cuda, N, K, weight_dtype, block, activation):
    """The gate/up projections of Qwen3-8B, Llama-3.2-3B and Gemma-3-1B, and a narrow one."""
    check_gated(N, K, weight_dtype, block, torch.bfloat16, N == 200, activation, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 2, 5])
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_cuda_each_kernel_and_split(cuda, kernel, split_k):
    for weight_dtype, block in [(torch.float8_e4m3fn, "1x128"), (torch.int8, "channel")]:
        check(5, 1000, 2560, weight_dtype, block, torch.bfloat16, True, cuda, kernel=kernel, split_k=split_k)


# -- the reference and the checks, on the CPU ----------------------------------------------------


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("bs", [(1, 7), (1, 3), (2, 2), (3, 4), (5, 7)])
def test_dequantize_weight_matches_a_loop(weight_dtype, bs):
    N, K = 5, 7
    weight, scale = make_weight(N, K, weight_dtype, bs, "cpu")
    expected = torch.empty(N, K)
    for n in range(N):
        for k in range(K):
            expected[n, k] = float(weight[n, k]) * float(scale[n // bs[0], k // bs[1]])
    torch.testing.assert_close(dequantize_weight(weight, scale, bs, torch.float32), expected, atol=0, rtol=0)
    torch.testing.assert_close(
        dequantize_weight(weight, scale, bs, torch.bfloat16), expected.to(torch.bfloat16), atol=0, rtol=0
    )


@pytest.mark.parametrize("block", BLOCKS)
def test_cpu_path_is_the_reference(block):
    bs = block_size(block, 200)
    weight, scale = make_weight(130, 200, torch.int8, bs, "cpu")
    x, bias = make_x(4, 200, torch.bfloat16, "cpu"), make_bias(130, torch.bfloat16, "cpu")
    out = quantized_linear(x, weight, scale, bs, bias)
    assert torch.equal(out, quantized_linear_ref(x, weight, scale, bs, bias))


def _valid():
    weight, scale = make_weight(130, 200, torch.int8, (128, 128), "cpu")
    return dict(x=torch.randn(3, 200), weight=weight, scale=scale, block_size=(128, 128))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=torch.randn(3, 200, dtype=torch.float64)), "x must be float32, float16 or bfloat16"),
        (dict(x=torch.randn(3, 199)), "x's last dim must be weight's K = 200"),
        (dict(weight=torch.zeros(130, 200, dtype=torch.int16)), "weight must be torch.int8 or torch.float8"),
        (dict(weight=torch.zeros(200, dtype=torch.int8)), "weight must be 2D"),
        (dict(weight=torch.zeros(200, 130, dtype=torch.int8).T), "weight must be contiguous"),
        (dict(scale=torch.ones(2, 2, dtype=torch.float16)), "scale must be float32"),
        (dict(scale=torch.ones(1, 2)), r"scale must have shape \[ceil\(N / bn\), ceil\(K / bk\)\] = \[2, 2"),
        (dict(block_size=(128,)), "block_size must be two positive ints"),
        (dict(block_size=(0, 128)), "block_size must be two positive ints"),
        (dict(bias=torch.zeros(129)), r"bias must have shape \[N\] = \[130\]"),
        (dict(bias=torch.zeros(130, dtype=torch.int32)), "bias must be float32, float16 or bfloat16"),
    ],
)
@pytest.mark.parametrize("op", [quantized_linear, quantized_linear_ref])
def test_rejects_bad_inputs(op, change, message):
    with pytest.raises(ValueError, match=message):
        op(**(_valid() | change))


def test_dequantize_weight_rejects_a_scale_of_the_wrong_shape():
    weight, _ = make_weight(130, 200, torch.float8_e4m3fn, (1, 200), "cpu")
    with pytest.raises(ValueError, match=r"= \[130, 1\] for weight \[130, 200\] and block_size \(1, 200\)"):
        dequantize_weight(weight, torch.ones(130, 2), (1, 200), torch.bfloat16)
