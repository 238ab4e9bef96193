"""rms_norm, add_rms_norm and rms_norm_add_rms_norm against their PyTorch references (tolerances:
infer.kernels.TOLERANCES), and rms_norm_add_rms_norm's reference against the two ops it fuses."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    TOLERANCES,
    add_rms_norm,
    add_rms_norm_ref,
    assert_close,
    rms_norm,
    rms_norm_add_rms_norm,
    rms_norm_add_rms_norm_ref,
    rms_norm_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Model hidden sizes (SmolLM2 576, Gemma 3 270m 640, Gemma 3 1b 1152, Llama 2048..8192) and
# sizes that are not a multiple of anything, to exercise the column mask.
MODEL_HIDDEN = [64, 576, 640, 1152, 2048, 3072, 4096, 8192]
ODD_HIDDEN = [1, 3, 100, 1000]


def make_inputs(tokens, hidden, dtype, device, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    return x, weight, residual


def make_next_weight(hidden, dtype, device):
    """A second norm's weight, unlike make_inputs' (a kernel that mixes the two up must fail)."""
    gen = torch.Generator().manual_seed(1)
    return (1 - 0.3 * torch.randn(hidden, generator=gen)).to(device, dtype)


def check_rms_norm(tokens, hidden, dtype, offset, device):
    x, weight, _ = make_inputs(tokens, hidden, dtype, device)
    assert_close(rms_norm(x, weight, 1e-6, offset=offset), rms_norm_ref(x, weight, 1e-6, offset=offset))


def check_add_rms_norm(tokens, hidden, dtype, offset, device):
    x, weight, residual = make_inputs(tokens, hidden, dtype, device)
    expected_residual = residual.clone()
    add_rms_norm_ref(x, expected_residual, weight, 1e-6, offset=offset)
    normed, returned = add_rms_norm(x, residual, weight, 1e-6, offset=offset)
    assert returned is residual, "add_rms_norm must update and return the caller's residual"
    assert_close(residual, expected_residual)
    # The norm is checked against the reference applied to the kernel's own sum, so a one-ulp
    # difference in the rounded sum is not counted twice.
    assert_close(normed, rms_norm_ref(residual, weight, 1e-6, offset=offset))


def assert_residual_close(actual, expected, normed_x):
    """The table's tolerance, plus one unit in the last place of each element of `normed_x`: x's
    norm is rounded to the dtype before the add (as the unfused rms_norm stores it), and two
    correct fp32 norms (or the interpreter, which truncates to bf16) may round an element to
    neighbouring values; the add carries that ulp into the residual even where the sum is near 0."""
    unit = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[actual.dtype]
    tolerance = TOLERANCES[actual.dtype]
    error = (actual.float() - expected.float()).abs()
    bound = tolerance.atol + tolerance.rtol * expected.float().abs() + unit * normed_x.float().abs()
    worst = (error - bound).max().item()
    assert worst <= 0, f"{(error > bound).sum().item()} elements beyond the bound, the worst by {worst:.3g}"


def check_rms_norm_add_rms_norm(tokens, hidden, dtype, offset, device):
    x, weight, residual = make_inputs(tokens, hidden, dtype, device)
    next_weight = make_next_weight(hidden, dtype, device)
    normed_x = rms_norm_ref(x, weight, 1e-6, offset=offset)
    expected_residual = residual.clone()
    rms_norm_add_rms_norm_ref(x, expected_residual, weight, next_weight, 1e-6, offset=offset)
    normed, returned = rms_norm_add_rms_norm(x, residual, weight, next_weight, 1e-6, offset=offset)
    assert returned is residual, "rms_norm_add_rms_norm must update and return the caller's residual"
    assert_residual_close(residual, expected_residual, normed_x)
    # As in check_add_rms_norm: the second norm is checked on the kernel's own sum.
    assert_close(normed, rms_norm_ref(residual, next_weight, 1e-6, offset=offset))


small_shapes = dict(
    tokens=st.integers(1, 40),
    hidden=st.sampled_from(MODEL_HIDDEN + ODD_HIDDEN),
    dtype=st.sampled_from(DTYPES),
    offset=st.sampled_from([0.0, 1.0]),
)


@settings(max_examples=30, deadline=None)
@given(**small_shapes)
def test_cpu_path_matches_reference(tokens, hidden, dtype, offset):
    """The three ops on a CPU tensor take the CPU path (rms_norm_cpu)."""
    check_rms_norm(tokens, hidden, dtype, offset, "cpu")
    check_add_rms_norm(tokens, hidden, dtype, offset, "cpu")
    check_rms_norm_add_rms_norm(tokens, hidden, dtype, offset, "cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**small_shapes)
def test_rms_norm_interpreted_matches_reference(triton_on_cpu, tokens, hidden, dtype, offset):
    check_rms_norm(tokens, hidden, dtype, offset, "cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**small_shapes)
def test_add_rms_norm_interpreted_matches_reference(triton_on_cpu, tokens, hidden, dtype, offset):
    check_add_rms_norm(tokens, hidden, dtype, offset, "cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**small_shapes)
def test_rms_norm_add_rms_norm_interpreted_matches_reference(triton_on_cpu, tokens, hidden, dtype, offset):
    check_rms_norm_add_rms_norm(tokens, hidden, dtype, offset, "cpu")


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", ODD_HIDDEN)
def test_rms_norm_add_rms_norm_interpreted_on_odd_sizes(triton_on_cpu, hidden, dtype, offset):
    """Every dtype and offset on hidden sizes that fill no power-of-two block (the column mask)."""
    check_rms_norm_add_rms_norm(5, hidden, dtype, offset, "cpu")


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_add_rms_norm_reference_is_the_two_ops_it_fuses(dtype, offset):
    """x normalised and rounded by `rms_norm`, then added and normalised again by `add_rms_norm`."""
    x, weight, residual = make_inputs(6, 100, dtype, "cpu")
    next_weight = make_next_weight(100, dtype, "cpu")
    normed_x = rms_norm(x, weight, 1e-6, offset=offset)
    expected_normed, expected_residual = add_rms_norm(
        normed_x, residual.clone(), next_weight, 1e-6, offset=offset
    )
    normed, residual = rms_norm_add_rms_norm_ref(x, residual, weight, next_weight, 1e-6, offset=offset)
    assert_residual_close(residual, expected_residual, normed_x)
    assert_close(normed, expected_normed)


def test_rms_norm_interpreted_takes_3d_and_strided_rows(triton_on_cpu):
    x, weight, _ = make_inputs(12, 130, torch.float32, "cpu")
    batched = x.view(3, 4, 130)
    assert_close(rms_norm(batched, weight, 1e-6), rms_norm_ref(batched, weight, 1e-6))
    every_other_row = x[::2]
    assert_close(rms_norm(every_other_row, weight, 1e-6), rms_norm_ref(every_other_row, weight, 1e-6))
    columns_strided = x.t().contiguous().t()  # last dim not contiguous: copied, read only
    assert_close(rms_norm(columns_strided, weight, 1e-6), rms_norm_ref(columns_strided, weight, 1e-6))


def test_add_rms_norm_interpreted_updates_a_strided_residual_view(triton_on_cpu):
    x, weight, residual = make_inputs(4, 64, torch.float32, "cpu")
    storage = torch.zeros(8, 64)
    view = storage[::2]
    view.copy_(residual)
    add_rms_norm(x, view, weight, 1e-6)
    assert_close(storage[::2], x + residual)
    assert torch.equal(storage[1::2], torch.zeros(4, 64)), "rows between the view's rows were written"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", MODEL_HIDDEN + ODD_HIDDEN)
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_rms_norm_cuda_matches_reference(cuda, tokens, hidden, dtype):
    check_rms_norm(tokens, hidden, dtype, 1.0 if hidden == 640 else 0.0, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", MODEL_HIDDEN + ODD_HIDDEN)
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_add_rms_norm_cuda_matches_reference(cuda, tokens, hidden, dtype):
    check_add_rms_norm(tokens, hidden, dtype, 1.0 if hidden == 640 else 0.0, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", MODEL_HIDDEN + ODD_HIDDEN)
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_rms_norm_add_rms_norm_cuda_matches_reference(cuda, tokens, hidden, dtype):
    check_rms_norm_add_rms_norm(tokens, hidden, dtype, 1.0 if hidden == 640 else 0.0, cuda)


@pytest.mark.gpu
def test_rms_norm_cuda_mixed_weight_dtype_and_3d(cuda):
    x, _, _ = make_inputs(6, 1152, torch.bfloat16, cuda)
    weight = torch.randn(1152, device=cuda)  # fp32 weight, bf16 activations
    batched = x.view(2, 3, 1152)
    assert_close(rms_norm(batched, weight, 1e-6), rms_norm_ref(batched, weight, 1e-6))


def test_rms_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="weight must have shape \\[64\\]"):
        rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)


def test_rms_norm_rejects_integer_input():
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        rms_norm(torch.ones(2, 64, dtype=torch.int32), torch.ones(64), 1e-6)


def test_add_rms_norm_rejects_a_residual_of_another_dtype():
    with pytest.raises(ValueError, match="x and residual must match"):
        add_rms_norm(torch.randn(2, 64), torch.randn(2, 64, dtype=torch.float16), torch.ones(64), 1e-6)


def test_rms_norm_add_rms_norm_rejects_a_next_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="next_weight must have shape \\[64\\]"):
        rms_norm_add_rms_norm(torch.randn(2, 64), torch.randn(2, 64), torch.ones(64), torch.ones(32), 1e-6)


def test_rms_norm_add_rms_norm_rejects_a_residual_of_another_shape():
    with pytest.raises(ValueError, match="x and residual must match"):
        rms_norm_add_rms_norm(torch.randn(2, 64), torch.randn(3, 64), torch.ones(64), torch.ones(64), 1e-6)


def test_add_rms_norm_interpreted_rejects_a_residual_with_strided_columns(triton_on_cpu):
    residual = torch.randn(64, 2).t()  # [2, 64] with column stride 2
    before = residual.clone()
    with pytest.raises(ValueError, match="residual must have a contiguous last dim"):
        add_rms_norm(torch.randn(2, 64), residual, torch.ones(64), 1e-6)
    assert torch.equal(residual, before), "the residual was written before the error"


def test_rms_norm_add_rms_norm_interpreted_rejects_a_residual_with_strided_columns(triton_on_cpu):
    residual = torch.randn(64, 2).t()  # [2, 64] with column stride 2
    before = residual.clone()
    with pytest.raises(ValueError, match="residual must have a contiguous last dim"):
        rms_norm_add_rms_norm(torch.randn(2, 64), residual, torch.ones(64), torch.ones(64), 1e-6)
    assert torch.equal(residual, before), "the residual was written before the error"
