"""rms_norm and add_rms_norm against their PyTorch references (tolerances: infer.kernels.TOLERANCES)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import add_rms_norm, add_rms_norm_ref, assert_close, rms_norm, rms_norm_ref

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


small_shapes = dict(
    tokens=st.integers(1, 40),
    hidden=st.sampled_from(MODEL_HIDDEN + ODD_HIDDEN),
    dtype=st.sampled_from(DTYPES),
    offset=st.sampled_from([0.0, 1.0]),
)


@settings(max_examples=30, deadline=None)
@given(**small_shapes)
def test_cpu_path_matches_reference(tokens, hidden, dtype, offset):
    """rms_norm and add_rms_norm on a CPU tensor take the CPU path (torch's fused F.rms_norm)."""
    check_rms_norm(tokens, hidden, dtype, offset, "cpu")
    check_add_rms_norm(tokens, hidden, dtype, offset, "cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**small_shapes)
def test_rms_norm_interpreted_matches_reference(triton_on_cpu, tokens, hidden, dtype, offset):
    check_rms_norm(tokens, hidden, dtype, offset, "cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**small_shapes)
def test_add_rms_norm_interpreted_matches_reference(triton_on_cpu, tokens, hidden, dtype, offset):
    check_add_rms_norm(tokens, hidden, dtype, offset, "cpu")


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


def test_add_rms_norm_interpreted_rejects_a_residual_with_strided_columns(triton_on_cpu):
    residual = torch.randn(64, 2).t()  # [2, 64] with column stride 2
    before = residual.clone()
    with pytest.raises(ValueError, match="residual must have a contiguous last dim"):
        add_rms_norm(torch.randn(2, 64), residual, torch.ones(64), 1e-6)
    assert torch.equal(residual, before), "the residual was written before the error"
