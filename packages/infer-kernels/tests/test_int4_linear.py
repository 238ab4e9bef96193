"""The 4-bit layout's references against a per-element reading of the bytes, their checks, and the
Triton kernels against the references.

The oracle reads each weight the way the layout is written down (infer.kernels.gemv.int4_layout):
byte k // 2 of row n, low nibble for even k, high for odd, minus the group's zero point (8 when
there is none), times the group's scale; sums of products in float64.

Kernels against `int4_linear_ref`. Inputs are scaled so that outputs are of order 1 (x ~ N(0, 1),
weights ~ 1/sqrt(K)). The reference rounds each weight `(q - zero) * scale` and each product to
fp32 and sums them. The kernels multiply `q - zero` (exact in any dtype) by x, exactly for
half-precision x (one rounding for fp32 x), sum those products (eight at a time in the GEMV, a
tile's in the MMA) and multiply the sums by the group's scale (one rounding): a few more
roundings of 2^-24 a term and another order of the sums, below the sums' own error once K is
past a few dozen. So:
- bf16 / fp16 outputs: the difference is far below one ulp of the output, and the two roundings
  may still land on neighbouring values: the tolerance table's two ulps (`assert_close`), as
  test_quantized_linear argues;
- fp32 outputs: the summation bound of test_quantized_linear, 4 * sqrt(K) * 2^-24 * (|x| @ |W|.T)
  per element (plus 1e-6), which at the smallest K here (64) is 32 roundings of the largest
  term.
Where the weight is rounded to x's dtype first (the dequantize-then-cuBLAS path of prefill chunks),
each product errs by at most the unit roundoff u of that
dtype (2^-8 in bf16, 2^-11 in fp16) times |x_k W_nk|, so the sums differ by at most
u * (|x| @ |W|.T); each side's rounding of its sum to x's dtype adds at most u of its magnitude:
`assert_matches_reference(..., rounded_weight=True)` allows both, plus the fp32 summation bound.
Both bounds stay far below what a wrong nibble or a missing zero point costs (errors of the order
of the outputs themselves), which `test_the_bounds_catch_a_swapped_nibble_or_a_dropped_zero` checks.
"""

import functools
import importlib
import math

import pytest
import torch

from infer.kernels import (
    assert_close,
    assert_gated_close,
    dequantize_int4,
    int4_gated_gemv,
    int4_gated_gemv_ref,
    int4_linear,
    int4_linear_ref,
    pack_int4,
    unpack_int4,
)
from infer.kernels.gemv.int4_linear import _dequantized, _launch

X_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GROUPS = [32, 64, 128]
# (N, K) of Qwen3-8B's projections: fused q/k/v, o, fused gate/up, down.
MODEL_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def _weight_by_element(qweight, scales, zeros, group_size) -> torch.Tensor:
    N, K = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty(N, K, dtype=torch.float64)
    for n in range(N):
        for k in range(K):
            byte = int(qweight[n, k // 2])
            q = byte & 0x0F if k % 2 == 0 else byte >> 4
            zero = 8 if zeros is None else int(zeros[n, k // group_size])
            out[n, k] = (q - zero) * float(scales[n, k // group_size])
    return out


def _random_weight(N, K, group_size, symmetric, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=generator, dtype=torch.uint8)
    scales = torch.rand(N, K // group_size, generator=generator) * 0.02 + 0.001
    zeros = (
        None
        if symmetric
        else torch.randint(0, 16, (N, K // group_size), generator=generator, dtype=torch.uint8)
    )
    return q, pack_int4(q), scales, zeros


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [8, 16])
def test_dequantize_reads_each_weight_as_the_layout_says(symmetric, group_size):
    q, qweight, scales, zeros = _random_weight(6, 32, group_size, symmetric)
    assert torch.equal(unpack_int4(qweight), q)
    expected = _weight_by_element(qweight, scales, zeros, group_size)
    torch.testing.assert_close(dequantize_int4(qweight, scales, zeros, group_size).double(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linear_is_the_product_with_the_dequantized_weight(dtype, symmetric):
    _, qweight, scales, zeros = _random_weight(24, 64, 16, symmetric, seed=1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(24, dtype=dtype)
    expected = x.double() @ _weight_by_element(qweight, scales, zeros, 16).T + bias.double()
    for fn in (int4_linear_ref, int4_linear):
        y = fn(x, qweight, scales, zeros, 16, bias)
        assert y.dtype == dtype and y.shape == (3, 24)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: {**w, "qweight": w["qweight"].to(torch.int8)}, "qweight must be a 2D uint8"),
        (lambda w: {**w, "group_size": 12}, "group_size must be even and divide"),
        (lambda w: {**w, "scales": w["scales"][:, :1]}, "scales must be"),
        (lambda w: {**w, "zeros": w["scales"].to(torch.int32)}, "zeros must be uint8"),
        (lambda w: {**w, "x": w["x"][:, :8]}, "x's last dim must be K"),
    ],
)
def test_int4_linear_refuses_a_malformed_layout(change, message):
    _, qweight, scales, zeros = _random_weight(4, 32, 16, symmetric=False)
    arguments = change(
        {"x": torch.randn(2, 32), "qweight": qweight, "scales": scales, "zeros": zeros, "group_size": 16}
    )
    with pytest.raises(ValueError, match=message):
        int4_linear(**arguments)


# -- the Triton kernels against the reference --------------------------------------------------


def make_weight(N, K, group_size, symmetric, device, scale_dtype=torch.float32, seed=0):
    """Packed weight, scales and zeros (None if `symmetric`) with |W| ~ 1/sqrt(K)."""
    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=generator, device=device, dtype=torch.uint8)
    groups = (N, K // group_size)
    scales = (0.5 + torch.rand(groups, generator=generator, device=device)) / (5 * math.sqrt(K))
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 16, groups, generator=generator, device=device, dtype=torch.uint8)
    return pack_int4(q), scales.to(scale_dtype), zeros


def make_x(M, K, dtype, device, seed=1):
    return torch.randn(M, K, generator=torch.Generator(device).manual_seed(seed), device=device).to(dtype)


def make_bias(N, dtype, device, seed=2):
    return torch.randn(N, generator=torch.Generator(device).manual_seed(seed), device=device).to(dtype)


def assert_matches_reference(out, x, qweight, scales, zeros, group_size, bias=None, rounded_weight=False):
    """`out` against `int4_linear_ref` within the module docstring's bounds."""
    expected = int4_linear_ref(x, qweight, scales, zeros, group_size, bias)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if expected.dtype != torch.float32 and not rounded_weight:
        assert_close(out, expected)
        return
    magnitude = sum_magnitude(x, qweight, scales, zeros, group_size, bias).reshape(out.shape)
    bound = 1e-6 + 4 * math.sqrt(x.shape[-1]) * 2.0**-24 * magnitude
    if rounded_weight:
        u = torch.finfo(x.dtype).eps / 2
        bound += u * magnitude + 2 * u * (expected.float().abs() + u * magnitude)
    error = (out.float() - expected.float()).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), (
        f"error {error.flatten()[worst].item():.3g} above its bound {bound.flatten()[worst].item():.3g}"
    )


def sum_magnitude(x, qweight, scales, zeros, group_size, bias=None):
    """`|x| @ |W|.T + |bias|`, the magnitude the sums' rounding errors are relative to."""
    weight = dequantize_int4(qweight, scales, zeros, group_size)
    magnitude = x.float().abs().reshape(-1, x.shape[-1]) @ weight.abs().T
    return magnitude if bias is None else magnitude + bias.float().abs()


def check_gated(N, K, group_size, symmetric, x_dtype, with_bias, activation, device, **launch):
    """int4_gated_gemv of a [2N, K] gate/up weight against the unfused reference (through
    `_launch` with `launch`'s overrides: the kernel, the GEMV's tiles, the K splits)."""
    qweight, scales, zeros = make_weight(2 * N, K, group_size, symmetric, device)
    x = make_x(1, K, x_dtype, device)
    bias = make_bias(2 * N, x_dtype, device) if with_bias else None
    if launch:
        launch.setdefault("pdl", True)
        out = _launch(x, qweight, scales, zeros, group_size, bias, activation=activation, **launch)
    else:
        out = int4_gated_gemv(x, qweight, scales, zeros, group_size, bias, activation=activation, pdl=True)
    expected = int4_gated_gemv_ref(x, qweight, scales, zeros, group_size, bias, activation=activation)
    gate_up = int4_linear_ref(x, qweight, scales, zeros, group_size, bias)
    error = None
    if x_dtype == torch.float32:
        error = 1e-6 + 4 * math.sqrt(K) * 2.0**-24 * sum_magnitude(
            x, qweight, scales, zeros, group_size, bias
        )
    assert_gated_close(out, expected, gate_up, activation, error)


def check(M, N, K, group_size, symmetric, x_dtype, with_bias, device, scale_dtype=torch.float32, **launch):
    """One product through `int4_linear` (or `_launch` with `launch`'s overrides) against the
    reference; the weight counts as rounded to x's dtype where the path rounds it."""
    qweight, scales, zeros = make_weight(N, K, group_size, symmetric, device, scale_dtype)
    x = make_x(M, K, x_dtype, device)
    bias = make_bias(N, x_dtype, device) if with_bias else None
    if launch:
        out = _launch(x, qweight, scales, zeros, group_size, bias, **launch)
    else:
        out = int4_linear(x, qweight, scales, zeros, group_size, bias, pdl=True)
    kernel = launch.get("kernel")
    dequantized = kernel == "dequantize" or (kernel is None and x.is_cuda and M >= 512)
    rounded = x_dtype != torch.float32 and dequantized
    assert_matches_reference(out, x, qweight, scales, zeros, group_size, bias, rounded)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("M", [1, 2, 5, 16, 33])
def test_interpreted_matches_reference(triton_on_cpu, M, group_size, symmetric, x_dtype, with_bias):
    """The kernel each M picks (the GEMV for one row, tensor cores for more), N = 40 rows: a
    partial tile of rows whatever the tile."""
    check(M, 40, 256, group_size, symmetric, x_dtype, with_bias, "cpu")


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_interpreted_each_kernel_and_split(triton_on_cpu, kernel, split_k, symmetric):
    """Both kernels with and without split-K (partial sums and their fixed-order reduction, which
    adds the bias), whatever the choice by shape would be; K = 384 is 6 groups of 64."""
    check(3, 40, 384, 64, symmetric, torch.bfloat16, True, "cpu", kernel=kernel, split_k=split_k, pdl=True)
    check(1, 40, 384, 64, symmetric, torch.float32, True, "cpu", kernel=kernel, split_k=split_k, pdl=True)


@pytest.mark.parametrize("symmetric", [True, False])
def test_interpreted_dequantize_then_matmul(triton_on_cpu, symmetric):
    """The prefill path: the weight dequantized to x's dtype in one pass (bit for bit
    `dequantize_int4`'s), then F.linear."""
    qweight, scales, zeros = make_weight(40, 384, 64, symmetric, "cpu")
    for dtype in X_DTYPES:
        expected = dequantize_int4(qweight, scales, zeros, 64, dtype)
        weight = _dequantized(qweight, scales, zeros, 64, dtype, pdl=True)
        if dtype == torch.bfloat16:  # the interpreter truncates to bf16 (a GPU rounds: test_cuda_...)
            torch.testing.assert_close(weight, expected, atol=0, rtol=torch.finfo(dtype).eps)
        else:
            assert torch.equal(weight, expected)
    check(3, 40, 384, 64, symmetric, torch.bfloat16, True, "cpu", kernel="dequantize")
    check(2, 40, 384, 64, symmetric, torch.float32, False, "cpu", kernel="dequantize")


@pytest.mark.parametrize("split_k", [1, 3])
def test_interpreted_small_tiles(triton_on_cpu, split_k):
    """Tiles smaller than a group (32 columns in groups of 64), unrolled steps, 16-row tiles over
    N = 37, for both kernels."""
    gemv = dict(BLOCK_N=16, BLOCK_K=32, UNROLL=2, num_warps=4, num_stages=1)
    dot = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_N=2, num_warps=4, num_stages=1)
    for M, kernel, config in [(1, "gemv", gemv), (2, "gemv", gemv), (5, "dot", dot)]:
        check(
            M, 37, 320, 64, False, torch.float16, True, "cpu", kernel=kernel, config=config, split_k=split_k
        )


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("group_size", [8, 12, 48, 320])
def test_interpreted_other_group_sizes(triton_on_cpu, group_size, M):
    """Groups that are not 32, 64 or 128: tiles the largest power of two dividing the group (8
    and 16 columns: the GEMV also takes M > 1 when a tile is too narrow for tl.dot), one group
    a row (K = 320); 12 has no factor 8 (a word, as both kernels read): dequantize-then-matmul."""
    K = 960 if group_size in (12, 48) else 320
    kernel = "dequantize" if group_size == 12 else None
    qweight, scales, zeros = make_weight(24, K, group_size, False, "cpu")
    x, bias = make_x(M, K, torch.bfloat16, "cpu"), make_bias(24, torch.bfloat16, "cpu")
    out = int4_linear(x, qweight, scales, zeros, group_size, bias)
    assert_matches_reference(
        out, x, qweight, scales, zeros, group_size, bias, rounded_weight=kernel is not None
    )


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_interpreted_half_precision_scales(triton_on_cpu, scale_dtype):
    for M in (1, 4):
        check(M, 40, 256, 128, False, torch.bfloat16, False, "cpu", scale_dtype=scale_dtype)


@pytest.mark.parametrize("kernel", ["gemv", "dot", "dequantize"])
def test_interpreted_matches_the_byte_by_byte_oracle(triton_on_cpu, kernel):
    _, qweight, scales, zeros = _random_weight(24, 64, 32, symmetric=False, seed=3)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    expected = x.double() @ _weight_by_element(qweight, scales, zeros, 32).T
    y = _launch(x, qweight, scales, zeros, 32, None, kernel=kernel)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("block_k", [32, 128])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_interpreted_gemv_with_each_tile_ahead(triton_on_cpu, prefetch, block_k, split_k):
    """The GEMV with no tile loaded ahead, the next tile's words and scales (1), and x's too (2):
    tiles inside a group of 64 and of two whole groups, K = 768 in 6 to 24 steps, split in three
    or not; and the gated GEMV, whose up rows take the same steps."""
    config = dict(BLOCK_N=16, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1, PREFETCH=prefetch)
    for x_dtype, symmetric in [(torch.bfloat16, False), (torch.float32, True)]:
        check(1, 40, 768, 64, symmetric, x_dtype, True, "cpu", kernel="gemv", config=config, split_k=split_k)
    if split_k == 1:
        check_gated(37, 768, 64, False, torch.bfloat16, True, "silu", "cpu", config=config)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", GROUPS)
def test_interpreted_gated_matches_the_unfused_pair(triton_on_cpu, group_size, symmetric):
    """The gate/up projection with its activation in one kernel: up rows N past their gate rows,
    with scales and zeros of their own; N = 37 leaves a partial tile of rows."""
    for x_dtype, with_bias, activation in [
        (torch.bfloat16, True, "silu"),
        (torch.float16, False, "silu"),
        (torch.float32, True, "gelu_tanh"),
    ]:
        check_gated(37, 256, group_size, symmetric, x_dtype, with_bias, activation, "cpu")


def test_gated_refuses_more_than_one_row_and_an_odd_weight():
    qweight, scales, zeros = make_weight(40, 256, 64, False, "cpu")
    with pytest.raises(ValueError, match="x must be one row of K = 256"):
        int4_gated_gemv(torch.randn(2, 256), qweight, scales, zeros, 64, activation="silu")
    qweight, scales, zeros = make_weight(41, 256, 64, False, "cpu")
    with pytest.raises(ValueError, match="even number of rows"):
        int4_gated_gemv_ref(torch.randn(1, 256), qweight, scales, zeros, 64, activation="silu")


def test_interpreted_keeps_leading_dims_and_reads_strided_x(triton_on_cpu):
    qweight, scales, zeros = make_weight(40, 256, 64, False, "cpu")
    x = torch.randn(2, 3, 256)
    out = int4_linear(x, qweight, scales, zeros, 64)
    assert out.shape == (2, 3, 40)
    assert_matches_reference(out, x, qweight, scales, zeros, 64)
    column_major = qweight.T.contiguous().T  # the same bytes, K / 2 apart along a row: copied
    for kernel in ("gemv", "dot", "dequantize"):
        out = _launch(x, column_major, scales, zeros, 64, None, kernel=kernel)
        assert_matches_reference(out, x, qweight, scales, zeros, 64, rounded_weight=kernel == "dequantize")
    for strided in (x[:, ::2], torch.randn(256, 4).T):
        assert_matches_reference(
            int4_linear(strided, qweight, scales, zeros, 64), strided, qweight, scales, zeros, 64
        )


def test_interpreted_empty_x(triton_on_cpu):
    qweight, scales, zeros = make_weight(40, 256, 64, False, "cpu")
    bias = make_bias(40, torch.float32, "cpu")
    out = int4_linear(torch.empty(0, 256), qweight, scales, zeros, 64, bias)
    assert out.shape == (0, 40)


@pytest.mark.parametrize("rounded_weight", [False, True])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_the_bounds_catch_a_swapped_nibble_or_a_dropped_zero(x_dtype, rounded_weight):
    """The bounds above are loose enough for summation order and rounding, and still fail a
    product with the nibbles of each byte swapped, or with the zero points left out."""
    qweight, scales, zeros = make_weight(40, 256, 64, False, "cpu")
    x = make_x(3, 256, x_dtype, "cpu")
    swapped = (qweight << 4) | (qweight >> 4)
    unshifted = torch.full_like(zeros, 8)  # as though symmetric: each group's own zero dropped
    for wrong in (
        int4_linear_ref(x, swapped, scales, zeros, 64),
        int4_linear_ref(x, qweight, scales, unshifted, 64),
    ):
        with pytest.raises(AssertionError):
            assert_matches_reference(wrong, x, qweight, scales, zeros, 64, rounded_weight=rounded_weight)


def test_a_gemv_tile_of_part_of_a_word_is_refused():
    qweight, scales, zeros = make_weight(32, 256, 64, False, "cpu")
    config = dict(BLOCK_N=16, BLOCK_K=4, UNROLL=1, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="BLOCK_K 4: the kernels read whole words of 8 columns"):
        _launch(torch.randn(1, 256), qweight, scales, zeros, 64, None, kernel="gemv", config=config)


def test_a_tile_across_groups_is_refused():
    """The tensor-core kernel's tile stays inside one group; the GEMV's holds whole groups of a
    power of two columns, a power of two of them, or stays inside one."""
    qweight, scales, zeros = make_weight(32, 256, 64, False, "cpu")
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, GROUP_N=8, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="BLOCK_K 128 straddles groups of 64 columns"):
        _launch(torch.randn(2, 256), qweight, scales, zeros, 64, None, kernel="dot", config=config)
    qweight, scales, zeros = make_weight(32, 288, 48, False, "cpu")
    config = dict(BLOCK_N=16, BLOCK_K=96, UNROLL=1, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="BLOCK_K 96 straddles groups of 48 columns"):
        _launch(torch.randn(1, 288), qweight, scales, zeros, 48, None, kernel="gemv", config=config)
    qweight, scales, zeros = make_weight(32, 384, 32, False, "cpu")
    for block_k in (96, 256):  # not a power of two; not dividing K
        config = dict(BLOCK_N=16, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1)
        with pytest.raises(ValueError, match=f"BLOCK_K {block_k}: a GEMV tile of whole groups"):
            _launch(torch.randn(1, 384), qweight, scales, zeros, 32, None, kernel="gemv", config=config)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("group_size, block_k", [(16, 64), (32, 128), (64, 256)])
def test_interpreted_gemv_tiles_of_whole_groups(
    triton_on_cpu, group_size, block_k, split_k, symmetric, x_dtype
):
    """A GEMV tile several groups wide, each word scaled by its own group's scale: K = 768
    (3 tiles of 256 columns), split in whole tiles."""
    config = dict(BLOCK_N=16, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1)
    check(
        1, 40, 768, group_size, symmetric, x_dtype, True, "cpu", kernel="gemv", config=config, split_k=split_k
    )


def test_cpu_path_is_the_reference():
    qweight, scales, zeros = make_weight(40, 256, 64, False, "cpu")
    x, bias = make_x(4, 256, torch.bfloat16, "cpu"), make_bias(40, torch.bfloat16, "cpu")
    out = int4_linear(x, qweight, scales, zeros, 64, bias)
    assert torch.equal(out, int4_linear_ref(x, qweight, scales, zeros, 64, bias))


# -- the compiled kernels on a GPU ----------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def cached_weight(N, K, symmetric):
    return make_weight(N, K, 128, symmetric, "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 4, 64, 600])
@pytest.mark.parametrize("N, K", MODEL_SHAPES)
def test_cuda_model_shapes_match_reference(cuda, N, K, M, x_dtype, symmetric):
    """Qwen3-8B's projections, groups of 128: the GEMV, tensor cores, and (600 rows) the weight
    dequantized for cuBLAS; M = 1 launched with PDL."""
    qweight, scales, zeros = cached_weight(N, K, symmetric)
    x = make_x(M, K, x_dtype, cuda)
    out = int4_linear(x, qweight, scales, zeros, 128, pdl=True)
    assert_matches_reference(out, x, qweight, scales, zeros, 128, rounded_weight=M >= 512)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("M", [1, 3, 33])
def test_cuda_groups_and_ragged_rows(cuda, M, group_size, symmetric, x_dtype):
    check(M, 200, 1024, group_size, symmetric, x_dtype, M % 2 == 1, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_dequantized_weight_is_the_reference_bit_for_bit(cuda, symmetric):
    qweight, scales, zeros = make_weight(1000, 2560, 128, symmetric, cuda, torch.bfloat16)
    for dtype in X_DTYPES:
        expected = dequantize_int4(qweight, scales, zeros, 128, dtype)
        assert torch.equal(_dequantized(qweight, scales, zeros, 128, dtype, pdl=True), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 2, 5])
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_cuda_each_kernel_and_split(cuda, kernel, split_k):
    for M in (1, 5):
        check(M, 1000, 2560, 128, False, torch.bfloat16, True, cuda, kernel=kernel, split_k=split_k, pdl=True)


def check_split_sums_in_the_gemv(device, calls, monkeypatch):
    """The one-row GEMV's split-K parts summed by its last program equal `_split_k_sum_kernel`'s
    sum bit for bit (the same additions in the same order, and the bias after them), call after
    call (each call's counts back to zero for the next), with PDL on every other call."""
    module = importlib.import_module("infer.kernels.gemv.int4_linear")
    weights = [make_weight(72, 1024, 128, False, device, torch.bfloat16, seed=seed) for seed in (0, 1)]
    x, bias = make_x(1, 1024, torch.bfloat16, device), make_bias(72, torch.bfloat16, device)
    config = dict(BLOCK_N=16, BLOCK_K=128, UNROLL=1, num_warps=4)
    products = {}
    for in_the_gemv in (False, True):
        monkeypatch.setattr(module, "SUM_IN_THE_GEMV", in_the_gemv)
        products[in_the_gemv] = [
            _launch(x, *weights[i % 2], 128, bias, kernel="gemv", config=config, split_k=4, pdl=i % 2 == 1)
            for i in range(calls)
        ]
    for ours, theirs in zip(products[True], products[False], strict=True):
        assert torch.equal(ours, theirs)
    assert not torch.equal(products[True][0], products[True][1])  # two weights, two products


def test_interpreted_split_sums_in_the_gemv_are_the_sum_kernels(triton_on_cpu, monkeypatch):
    check_split_sums_in_the_gemv("cpu", 4, monkeypatch)


@pytest.mark.gpu
def test_cuda_split_sums_in_the_gemv_are_the_sum_kernels(cuda, monkeypatch):
    check_split_sums_in_the_gemv(cuda, 50, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "gemv"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("N, K", [(12288, 4096), (200, 1024)])
def test_cuda_gated_matches_the_unfused_pair(cuda, N, K, activation, kernel):
    """Qwen3-8B's gate/up projection, and a narrow one with a partial tile: the default kernel
    (gemv.int4_mma) and the Triton GEMV."""
    check_gated(N, K, 128, False, torch.bfloat16, N == 200, activation, cuda, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("rows, columns, warps", [(128, 128, 8), (64, 256, 4), (256, 128, 8)])
def test_cuda_gemv_tiles_with_each_tile_ahead(cuda, rows, columns, warps, prefetch):
    """Qwen3-8B's q|k|v and (with its activation) gate|up shapes and a narrow partial tile, each
    tile the default rule picks for some shape, with each choice of what is loaded ahead."""
    config = dict(BLOCK_N=rows, BLOCK_K=columns, UNROLL=1, num_warps=warps, num_stages=1, PREFETCH=prefetch)
    check(1, 6144, 4096, 128, False, torch.bfloat16, True, cuda, kernel="gemv", config=config)
    check(1, 200, 1024, 128, True, torch.float16, False, cuda, kernel="gemv", config=config, split_k=2)
    check_gated(12288, 4096, 128, False, torch.bfloat16, False, "silu", cuda, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_mma_gemv_matches_reference(cuda, symmetric, x_dtype):
    """The one-row GEMV on tensor cores (gemv.int4_mma): Qwen3-8B's four shapes with the K splits
    it picks (their parts summed by each tile's last program); a partial tile of rows with an odd
    count of groups (K = 384: a group a step) and a bias, unsplit; 20 groups in 5 splits (not a
    power of two) of 2 steps of 2 groups, with PDL (its first words read before the wait)."""
    for N, K in MODEL_SHAPES:
        check(1, N, K, 128, symmetric, x_dtype, False, cuda, kernel="mma")
    check(1, 200, 384, 128, symmetric, x_dtype, True, cuda, kernel="mma", split_k=1)
    check(1, 1000, 2560, 128, symmetric, x_dtype, True, cuda, kernel="mma", split_k=5, pdl=True)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_mma_gated_matches_the_unfused_pair(cuda, symmetric, x_dtype):
    """gemv.int4_mma with the activation: Qwen3-8B's gate|up with the K splits it picks; 100
    outputs (a partial tile of 32 gate rows and their up rows) with a bias, unsplit and in 3
    splits of 2 groups, and GELU with PDL, in 5."""
    check_gated(12288, 4096, 128, symmetric, x_dtype, False, "silu", cuda, kernel="mma")
    check_gated(100, 768, 128, symmetric, x_dtype, True, "silu", cuda, kernel="mma", split_k=1)
    check_gated(100, 768, 128, symmetric, x_dtype, True, "silu", cuda, kernel="mma", split_k=3)
    check_gated(1000, 2560, 128, symmetric, x_dtype, True, "gelu_tanh", cuda, kernel="mma", split_k=5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_mma_gemv_refuses_what_it_does_not_take(device):
    """`kernel="mma"` asked of what it cannot run (CPU x, fp32 x, groups of 64, two rows) is
    refused by name, not run some other way."""
    qweight, scales, zeros = make_weight(64, 256, 128, False, device)
    cases = [(make_x(1, 256, torch.float32, device), 128), (make_x(2, 256, torch.bfloat16, device), 128)]
    if device == "cuda":
        x = make_x(1, 256, torch.bfloat16, device)
        with pytest.raises(ValueError, match="kernel 'mma'"):
            _launch(x, *make_weight(64, 256, 64, False, device), 64, None, kernel="mma")
    else:
        cases.append((make_x(1, 256, torch.bfloat16, device), 128))
    for x, group_size in cases:
        with pytest.raises(ValueError, match="kernel 'mma'"):
            _launch(x, qweight, scales, zeros, group_size, None, kernel="mma")


@pytest.mark.gpu
@pytest.mark.parametrize("prmt", [True, False])
@pytest.mark.parametrize("group_size", GROUPS)
def test_cuda_unpacks_with_and_without_its_ptx(cuda, group_size, prmt):
    """Both kernels' PTX unpacking (PRMT, which the interpreter cannot run) and the plain Triton
    one, each against the reference, with tiles of several widths."""
    for block_n, block_k in [(64, 128), (32, 32), (16, 8), (16, 512)]:
        block_k = block_k if block_k > 128 else min(block_k, group_size)  # 512: whole groups
        config = dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=2, num_warps=4, PRMT=prmt)
        for symmetric in (True, False):
            check(
                1, 1000, 2560, group_size, symmetric, torch.float16, True, cuda, kernel="gemv", config=config
            )
    for block_n, block_k in [(64, 128), (32, 32)]:
        config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=min(block_k, group_size), GROUP_N=8, PRMT=prmt)
        check(7, 1000, 2560, group_size, False, torch.bfloat16, True, cuda, kernel="dot", config=config)
