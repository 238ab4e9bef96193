"""normed_gemv (a pre-norm block's norm, with the residual add, and the projection after it, in
one kernel) against normed_gemv_ref: the norm kernels' references, then gemv_ref.

Tolerance. The kernel normalises the row with its own reduction, whose order differs from the
reference's: the inverse RMS may differ in its last fp32 bit, and then a normalised value may
round to the neighbouring value of x's dtype (one unit in the last place, `eps` relative). Each
such unit moves the output by at most `eps * |w_i| * |normed_i|`; the output's own rounding adds
one unit of it, and fp32 products and sums a few more (as test_gemv's bound). The new residual
is the rounded sum of x (or its norm) and the residual, within a unit of the reference's (the
interpreter rounds fp32 to bf16 otherwise than torch does), plus what x's own norm may differ
by: a unit of a rounding to bf16, or a few in fp32 (1/sqrt against rsqrt, then two products).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    normed_gated_gemv,
    normed_gated_gemv_ref,
    normed_gemv,
    normed_gemv_ref,
)
from infer.kernels.gemv.configs import NORMED_MAX_K


def make(N, K, dtype, device, *, sandwich, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(1, K, generator=gen, device=device).to(dtype)
    residual = (4 * torch.randn(1, K, generator=gen, device=device)).to(dtype)
    norm_weight = torch.randn(K, generator=gen, device=device).to(dtype)
    x_norm_weight = torch.randn(K, generator=gen, device=device).to(dtype) if sandwich else None
    weight = (torch.randn(N, K, generator=gen, device=device) * K**-0.5).to(dtype)
    return x, residual, norm_weight, weight, x_norm_weight


def assert_matches_reference(x, residual, norm_weight, weight, eps, offset, x_norm_weight, pdl=False):
    before = residual.clone()
    out, new_residual = normed_gemv(
        x, residual, norm_weight, weight, eps, offset=offset, x_norm_weight=x_norm_weight, pdl=pdl
    )
    expected, expected_residual = normed_gemv_ref(
        x, residual, norm_weight, weight, eps, offset=offset, x_norm_weight=x_norm_weight
    )
    assert torch.equal(residual, before), "the residual passed in must be left as it is"
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert new_residual.shape == residual.shape and new_residual.dtype == residual.dtype
    unit = torch.finfo(x.dtype).eps
    summed = expected_residual.float()
    # What joined the residual (x, or x's norm) may be off by a unit (a rounding to bf16), or in
    # fp32 by a few (1/sqrt against rsqrt, then two products): the sum by as much, and a unit.
    joined = (summed - residual.float()).abs()
    units = 1 if x_norm_weight is None else 4
    residual_error = (new_residual.float() - summed).abs()
    assert (residual_error <= unit * (summed.abs() + units * joined) + 1e-30).all()
    # Each normalised value may be off by the sum's error and a unit of its own, and the inverse
    # RMS by about a unit: twice that through the norm, then the fp32 products and sums (as
    # test_gemv's bound) and the output's own rounding.
    inv_rms = torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps)
    scale = (offset + norm_weight.float()).abs()
    normed = summed.abs() * inv_rms * scale
    perturbed = (summed.abs() + units * joined) * inv_rms * scale
    K = x.shape[-1]
    weights = weight.abs().float().T
    bound = (
        2 * unit * (perturbed @ weights)
        + 8 * math.sqrt(K) * 2.0**-24 * (normed @ weights)
        + unit * expected.float().abs()
        + 1e-6
    ).reshape(out.shape)
    error = (out.float() - expected.float()).abs()
    assert (error <= bound).all(), f"error {error.max().item():.3g} above its bound"


# -- the Triton kernel through the interpreter ---------------------------------------------------


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    N=st.integers(1, 40),
    K=st.integers(1, NORMED_MAX_K),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    sandwich=st.booleans(),
    offset=st.sampled_from([0.0, 1.0]),
)
def test_interpreted_matches_reference(triton_on_cpu, N, K, dtype, sandwich, offset):
    """Any N (partial row tiles) and K up to one tile; with and without x's own norm first."""
    x, residual, norm_weight, weight, x_norm_weight = make(N, K, dtype, "cpu", sandwich=sandwich)
    assert_matches_reference(x, residual, norm_weight, weight, 1e-6, offset, x_norm_weight)


@pytest.mark.parametrize("sandwich", [False, True], ids=["add-norm", "norm-add-norm"])
def test_interpreted_model_widths(triton_on_cpu, sandwich):
    """Gemma-3-1B's (1152, not a power of two) and Llama's and Qwen's (2048) hidden sizes, several
    row tiles, so that only program 0 writes the residual and every program reads the old one."""
    for K in (1152, 2048):
        tensors = make(24, K, torch.bfloat16, "cpu", sandwich=sandwich)
        x, residual, norm_weight, weight, x_norm_weight = tensors
        offset = 1.0 if sandwich else 0.0
        assert_matches_reference(x, residual, norm_weight, weight, 1e-6, offset, x_norm_weight)


def test_refuses_rows_wider_than_a_tile_and_mismatched_shapes():
    x, residual, norm_weight, weight, _ = make(4, NORMED_MAX_K + 1, torch.float32, "cpu", sandwich=False)
    with pytest.raises(ValueError, match=f"at most {NORMED_MAX_K}"):
        normed_gemv(x, residual, norm_weight, weight, 1e-6)
    x, residual, norm_weight, weight, _ = make(4, 64, torch.float32, "cpu", sandwich=False)
    with pytest.raises(ValueError, match="residual must match x"):
        normed_gemv(x, residual[:, :32], norm_weight, weight, 1e-6)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        normed_gemv(x, residual, norm_weight, weight.T.contiguous(), 1e-6)
    with pytest.raises(ValueError, match="x_norm_weight must have shape"):
        normed_gemv(x, residual, norm_weight, weight, 1e-6, x_norm_weight=norm_weight[:10])
    with pytest.raises(ValueError, match="x must be one row"):
        normed_gemv(torch.zeros(2, 64), torch.zeros(2, 64), norm_weight, weight, 1e-6)


# -- the compiled kernel on a GPU ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("sandwich", [False, True], ids=["add-norm", "norm-add-norm"])
@pytest.mark.parametrize("shape", [(1536, 1152), (3072, 2048), (4096, 2048), (37, 576)])
def test_cuda_matches_reference(cuda, shape, sandwich, pdl):
    """The 1-2B models' q|k|v projections (and SmolLM2's width with a partial row tile), bf16."""
    N, K = shape
    x, residual, norm_weight, weight, x_norm_weight = make(N, K, torch.bfloat16, cuda, sandwich=sandwich)
    offset = 1.0 if sandwich else 0.0
    assert_matches_reference(x, residual, norm_weight, weight, 1e-6, offset, x_norm_weight, pdl)


# -- normed_gated_gemv ---------------------------------------------------------------------------


def assert_gated_matches_reference(
    x, residual, norm_weight, weight, eps, offset, x_norm_weight, activation, pdl=False
):
    """The new residual against the norm kernels' references, within the roundings
    test_normed_gemv allows. The output against RMSNorm's arithmetic done exactly (float64) on
    that residual h: `act(gate) * up` of `W (h / rms(h) * (offset + norm_weight))`, the kernel's
    own rounding of the normed row left out, since it has none: it scales fp32 sums by the inverse
    RMS. Gate and up (row j) are within fp32 sums (as test_gemv's bound) and a unit of their
    rounding to x's dtype; the activation (slope at most 1.13) and the product pass those on, and
    the output rounds once more."""
    before = residual.clone()
    args = (x, residual, norm_weight, weight, eps)
    options = dict(activation=activation, offset=offset, x_norm_weight=x_norm_weight)
    out, new_residual = normed_gated_gemv(*args, **options, pdl=pdl)
    _, expected_residual = normed_gated_gemv_ref(*args, **options)
    assert torch.equal(residual, before), "the residual passed in must be left as it is"
    assert out.shape == (*x.shape[:-1], weight.shape[0] // 2) and out.dtype == x.dtype
    unit = torch.finfo(x.dtype).eps
    summed = expected_residual.float()
    units = 1 if x_norm_weight is None else 4
    joined = (summed - residual.float()).abs()
    assert ((new_residual.float() - summed).abs() <= unit * (summed.abs() + units * joined) + 1e-30).all()
    h = new_residual.double().reshape(-1)
    K, N = x.shape[-1], weight.shape[0] // 2
    normed = h / torch.sqrt((h * h).mean() + eps) * (offset + norm_weight.double())
    products = normed.abs()[None, :] * weight.abs().double()  # [2N, K]
    projected = weight.double() @ normed
    bound = unit * projected.abs() + 8 * math.sqrt(K) * 2.0**-24 * products.sum(dim=1) + 1e-6
    gate, up = projected[:N], projected[N:]
    gate_bound, up_bound = bound[:N], bound[N:]
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    exact = act * up
    total = 1.13 * gate_bound * (up.abs() + up_bound) + act.abs() * up_bound + unit * exact.abs() + 1e-6
    error = (out.double().reshape(-1) - exact).abs()
    assert (error <= total).all(), f"error {error.max().item():.3g} above its bound"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    N=st.integers(1, 40),
    K=st.integers(1, NORMED_MAX_K),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    sandwich=st.booleans(),
    activation=st.sampled_from(["silu", "gelu_tanh"]),
)
def test_gated_interpreted_matches_reference(triton_on_cpu, N, K, dtype, sandwich, activation):
    """Any N (one program or several, and partial row tiles) and any K up to NORMED_MAX_K (one to eight
    of the kernel's K tiles, the last partial)."""
    x, residual, norm_weight, weight, x_norm_weight = make(2 * N, K, dtype, "cpu", sandwich=sandwich)
    offset = 1.0 if sandwich else 0.0
    assert_gated_matches_reference(x, residual, norm_weight, weight, 1e-6, offset, x_norm_weight, activation)


def test_gated_interpreted_streams_rows_of_several_k_tiles(triton_on_cpu):
    """Gemma's hidden size: 1152 columns, 4.5 of the kernel's K tiles, and a partial row tile."""
    x, residual, norm_weight, weight, x_norm_weight = make(2 * 37, 1152, torch.bfloat16, "cpu", sandwich=True)
    assert_gated_matches_reference(x, residual, norm_weight, weight, 1e-6, 1.0, x_norm_weight, "gelu_tanh")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize(
    "shape, sandwich, activation",
    [((13824, 1152), True, "gelu_tanh"), ((16384, 2048), False, "silu"), ((12288, 2048), False, "silu")],
    ids=["gemma", "llama", "qwen"],
)
def test_gated_cuda_matches_reference(cuda, shape, sandwich, activation, pdl):
    """The 1-2B models' gate|up projections, bf16."""
    x, residual, norm_weight, weight, x_norm_weight = make(*shape, torch.bfloat16, cuda, sandwich=sandwich)
    offset = 1.0 if sandwich else 0.0
    assert_gated_matches_reference(
        x, residual, norm_weight, weight, 1e-6, offset, x_norm_weight, activation, pdl
    )
