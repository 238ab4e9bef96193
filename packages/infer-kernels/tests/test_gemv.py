"""gemv (the M = 1 kernel of quantized_linear on a dense weight) against gemv_ref, and
gated_gemv (the same kernel with a gated MLP's activation on its output) against gated_gemv_ref.

Tolerance. bf16 and fp16 products are exact in fp32 (8 or 11 significant bits times as many), so
the kernel and the reference add the same K terms in fp32 in different orders and round once to
x's dtype: `infer.kernels.assert_close`, as for every op (see test_quantized_linear.py). fp32
products are rounded too, once each: a bound of 8 * sqrt(K) * 2^-24 * (|x| @ |W|.T) per element
covers both the products' and the sums' rounding, which add up like random walks.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    assert_close,
    assert_gated_close,
    gated_gemv,
    gated_gemv_ref,
    gemv,
    gemv_ref,
)

# (N, K) of the 1-2B models' projections: Gemma-3-1B qkv, o, gate_up, down; Llama-3.2-1B qkv,
# gate_up, down; Qwen3-1.7B qkv and o (Llama's o too).
MODEL_SHAPES = [
    (1536, 1152),
    (1152, 1024),
    (13824, 1152),
    (1152, 6912),
    (3072, 2048),
    (16384, 2048),
    (2048, 8192),
    (4096, 2048),
    (2048, 2048),
]


def make(N, K, dtype, device, with_bias=False, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    weight = (torch.randn(N, K, generator=gen, device=device) * K**-0.5).to(dtype)
    x = torch.randn(1, K, generator=gen, device=device).to(dtype)
    bias = torch.randn(N, generator=gen, device=device).to(dtype) if with_bias else None
    return x, weight, bias


def assert_matches_reference(out, x, weight, bias=None):
    expected = gemv_ref(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if expected.dtype != torch.float32:
        assert_close(out, expected)
        return
    K = weight.shape[1]
    magnitude = x.abs().reshape(1, K) @ weight.abs().T
    bound = 1e-6 + 8 * math.sqrt(K) * 2.0**-24 * magnitude.reshape(out.shape)
    error = (out - expected).abs()
    assert (error <= bound).all(), f"fp32 error {error.max().item():.3g} above its bound"


def assert_gated_matches_reference(out, x, weight, bias, activation):
    expected = gated_gemv_ref(x, weight, bias, activation=activation)
    gate_up = gemv_ref(x, weight, bias)
    sum_error = None
    if out.dtype == torch.float32:  # the sums' own bound, as assert_matches_reference's
        K = weight.shape[1]
        magnitude = x.abs().reshape(1, K).float() @ weight.abs().float().T
        if bias is not None:
            magnitude += bias.abs().float()
        sum_error = (1e-6 + 8 * math.sqrt(K) * 2.0**-24 * magnitude).reshape(gate_up.shape)
    assert_gated_close(out, expected, gate_up, activation, sum_error)


# -- the Triton kernel through the interpreter ---------------------------------------------------


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    N=st.integers(1, 300),
    K=st.integers(1, 1100),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    with_bias=st.booleans(),
)
def test_interpreted_matches_reference(triton_on_cpu, N, K, dtype, with_bias):
    """Any N and K: partial row tiles, a K tile wider than K, and K past one 1024-column tile."""
    x, weight, bias = make(N, K, dtype, "cpu", with_bias)
    assert_matches_reference(gemv(x, weight, bias), x, weight, bias)


def test_interpreted_keeps_leading_dims_and_reads_strided_x(triton_on_cpu):
    x, weight, _ = make(130, 200, torch.float32, "cpu")
    out = gemv(x.view(1, 1, 200), weight)
    assert out.shape == (1, 1, 130)
    assert_matches_reference(out, x.view(1, 1, 200), weight)
    strided = torch.randn(200, 3)[:, 1]  # a column: elements 3 apart
    assert_matches_reference(gemv(strided, weight), strided, weight)


def test_interpreted_few_row_tiles_split_k_and_sum_the_splits(triton_on_cpu):
    """8 rows are 2 tiles, too few for the SMs: K = 4096 is split 4 ways into fp32 partial sums,
    which `_split_k_sum_kernel` adds, with the bias."""
    x, weight, bias = make(8, 4096, torch.float32, "cpu", with_bias=True)
    assert_matches_reference(gemv(x, weight, bias), x, weight, bias)


def test_interpreted_wide_layers_take_their_own_tiles(triton_on_cpu):
    """N >= 8192 runs the gate|up configuration (8 x 256 tiles)."""
    x, weight, bias = make(8200, 96, torch.float32, "cpu", with_bias=True)
    assert_matches_reference(gemv(x, weight, bias), x, weight, bias)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    N=st.integers(1, 150),
    K=st.integers(1, 1100),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    with_bias=st.booleans(),
    activation=st.sampled_from(["silu", "gelu_tanh"]),
)
def test_interpreted_gated_matches_reference(triton_on_cpu, N, K, dtype, with_bias, activation):
    """Any N and K, the up rows at N past the gate rows, with either activation."""
    x, weight, bias = make(2 * N, K, dtype, "cpu", with_bias)
    out = gated_gemv(x, weight, bias, activation=activation)
    assert_gated_matches_reference(out, x, weight, bias, activation)


def test_interpreted_gated_wide_layers_and_few_row_tiles(triton_on_cpu):
    """A gate/up weight of 8200 rows runs the wide layers' tiles; 16 rows are two tiles, which
    the plain GEMV would split along K (the gated one never does: its activation needs whole
    sums)."""
    for N, K in [(4100, 96), (8, 4096)]:
        x, weight, bias = make(2 * N, K, torch.float32, "cpu", with_bias=True)
        out = gated_gemv(x, weight, bias, activation="silu")
        assert_gated_matches_reference(out, x, weight, bias, "silu")


# -- the compiled kernel on a GPU ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, K", MODEL_SHAPES)
def test_cuda_model_shapes_match_reference(cuda, N, K, dtype):
    x, weight, bias = make(N, K, dtype, cuda, with_bias=N == 1536)
    assert_matches_reference(gemv(x, weight, bias), x, weight, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, K", [(13824, 1152), (16384, 2048), (12288, 2048), (512, 576)])
def test_cuda_gated_model_shapes_match_reference(cuda, N, K, dtype, activation):
    """The gate/up projections of Gemma-3-1B, Llama-3.2-1B, Qwen3-1.7B and a narrow one."""
    x, weight, bias = make(N, K, dtype, cuda, with_bias=N == 512)
    out = gated_gemv(x, weight, bias, activation=activation)
    assert_gated_matches_reference(out, x, weight, bias, activation)


@pytest.mark.gpu
def test_cuda_more_row_tiles_than_a_grid_dimension_holds(cuda):
    """600,000 rows are 75,000 tiles of 8: past the 65,535 programs of a grid's second
    dimension, so the tiles grow."""
    x, weight, bias = make(600_000, 64, torch.bfloat16, cuda, with_bias=True)
    assert_matches_reference(gemv(x, weight, bias), x, weight, bias)


@pytest.mark.gpu
def test_cuda_chain_launched_with_pdl_matches_plain_launches(cuda):
    """Each GEMV of a chain reads the one before it: with PDL, a kernel that did not wait for its
    predecessor would read a half-written x."""
    weights = [make(2048, 2048, torch.bfloat16, cuda, seed=s)[1] for s in range(8)]
    x = make(2048, 2048, torch.bfloat16, cuda)[0]

    def chain(pdl: bool = False):
        y = x
        for weight in weights:
            y = gemv(y, weight, pdl=pdl)
        return y

    plain = chain()
    graph = torch.cuda.CUDAGraph()
    chain(pdl=True)  # compile the PDL variant outside the graph
    with torch.cuda.graph(graph):
        out = chain(pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


# -- the reference and the checks, on the CPU ----------------------------------------------------


def test_cpu_path_is_the_reference():
    x, weight, bias = make(70, 90, torch.bfloat16, "cpu", with_bias=True)
    assert torch.equal(gemv(x, weight, bias), gemv_ref(x, weight, bias))
    expected = (x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)
    assert torch.equal(gemv_ref(x, weight, bias), expected)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=torch.randn(2, 200)), r"x must be one row of K = 200"),
        (dict(x=torch.randn(1, 199)), r"x must be one row of K = 200"),
        (dict(x=torch.randn(1, 200, dtype=torch.float64)), "x must be float32, float16 or bfloat16"),
        (
            dict(weight=torch.randn(130, 200, dtype=torch.bfloat16)),
            "weight must be a contiguous 2D torch.float32",
        ),
        (dict(weight=torch.randn(200, 130).T), "weight must be a contiguous 2D"),
        (dict(bias=torch.zeros(129)), r"bias must be a \[130\] torch.float32 tensor"),
    ],
)
@pytest.mark.parametrize("op", [gemv, gemv_ref])
def test_rejects_bad_inputs(op, change, message):
    valid = dict(x=torch.randn(1, 200), weight=torch.randn(130, 200), bias=None)
    with pytest.raises(ValueError, match=message):
        op(**(valid | change))


def test_gated_cpu_path_is_the_unfused_pair():
    x, weight, bias = make(140, 90, torch.bfloat16, "cpu", with_bias=True)
    for activation, op in [("silu", torch.nn.functional.silu), ("gelu_tanh", None)]:
        out = gated_gemv(x, weight, bias, activation=activation)
        assert torch.equal(out, gated_gemv_ref(x, weight, bias, activation=activation))
        gate, up = gemv_ref(x, weight, bias).float().chunk(2, dim=-1)
        act = op(gate) if op else torch.nn.functional.gelu(gate, approximate="tanh")
        assert torch.equal(out, (act * up).to(torch.bfloat16))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weight=torch.randn(131, 200)), "weight must have an even number of rows"),
        (dict(activation="relu"), "activation must be one of"),
        (dict(x=torch.randn(1, 199)), r"x must be one row of K = 200"),
    ],
)
@pytest.mark.parametrize("op", [gated_gemv, gated_gemv_ref])
def test_gated_rejects_bad_inputs(op, change, message):
    valid = dict(x=torch.randn(1, 200), weight=torch.randn(130, 200), bias=None, activation="silu")
    with pytest.raises(ValueError, match=message):
        op(**(valid | change))
