"""silu_and_mul and gelu_tanh_and_mul against their PyTorch references."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    assert_close,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = {
    "silu_and_mul": (silu_and_mul, silu_and_mul_ref),
    "gelu_tanh_and_mul": (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
}
# Intermediate sizes of the target models (SmolLM2 1536, Gemma 3 270m 2048, Llama 8192 / 14336)
# and ragged sizes that end mid-block.
INTERMEDIATE = [64, 1536, 2048, 6912, 8192, 14336]
ODD_INTERMEDIATE = [1, 3, 1100]


def check_op(op_name, tokens, intermediate, dtype, device):
    op, ref = OPS[op_name]
    gen = torch.Generator().manual_seed(tokens * 31 + intermediate)
    gate_up = (2 * torch.randn(tokens, 2 * intermediate, generator=gen)).to(device, dtype)
    out = op(gate_up)
    assert out.shape == (tokens, intermediate)
    assert_close(out, ref(gate_up))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    op_name=st.sampled_from(sorted(OPS)),
    tokens=st.integers(1, 24),
    intermediate=st.sampled_from(INTERMEDIATE[:4] + ODD_INTERMEDIATE),
    dtype=st.sampled_from(DTYPES),
)
def test_activation_interpreted_matches_reference(triton_on_cpu, op_name, tokens, intermediate, dtype):
    check_op(op_name, tokens, intermediate, dtype, "cpu")


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_activation_interpreted_keeps_leading_dims_and_reads_strided_input(triton_on_cpu, op_name):
    op, ref = OPS[op_name]
    gate_up = torch.randn(2, 3, 2 * 96)
    assert op(gate_up).shape == (2, 3, 96)
    assert_close(op(gate_up), ref(gate_up))
    every_other_token = gate_up[:, ::2]
    assert_close(op(every_other_token), ref(every_other_token))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", INTERMEDIATE + ODD_INTERMEDIATE)
@pytest.mark.parametrize("tokens", [1, 5, 256, 4096])
@pytest.mark.parametrize("op_name", sorted(OPS))
def test_activation_cuda_matches_reference(cuda, op_name, tokens, intermediate, dtype):
    check_op(op_name, tokens, intermediate, dtype, cuda)


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_activation_rejects_an_odd_last_dim(op_name):
    op, _ = OPS[op_name]
    with pytest.raises(ValueError, match="gate_up's last dim must be even"):
        op(torch.randn(2, 7))


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_activation_rejects_float64(op_name):
    op, _ = OPS[op_name]
    with pytest.raises(ValueError, match="gate_up must be float32, float16 or bfloat16"):
        op(torch.randn(2, 8, dtype=torch.float64))
