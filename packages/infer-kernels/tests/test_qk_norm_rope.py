"""qk_norm_rope against its reference (rms_norm_ref of each head, rounded, then rope_ref), and the
reference against the two public ops it fuses."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    TOLERANCES,
    assert_close,
    qk_norm_rope,
    qk_norm_rope_ref,
    rms_norm,
    rms_norm_ref,
    rope,
    rope_tables,
)

MAX_POSITIONS = 4096


def make_inputs(tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, *, fused_qkv, seed=0):
    """q and k ([T, H, D], views of one q|k|v tensor when fused_qkv), the two norm weights, the
    rotary tables and each token's position (in no particular order)."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if fused_qkv:
        qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).mul(3).to(device, dtype)
        q = qkv[:, :q_size].view(tokens, num_q_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    else:
        q = torch.randn(tokens, num_q_heads, head_dim, generator=gen).mul(3).to(device, dtype)
        k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).mul(3).to(device, dtype)
    q_weight = torch.randn(head_dim, generator=gen).to(device, dtype)
    k_weight = torch.randn(head_dim, generator=gen).to(device, dtype)
    cos, sin = rope_tables(head_dim, MAX_POSITIONS, 1e6, device=device)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen).to(device)
    return q, k, q_weight, k_weight, cos, sin, positions


def assert_close_after_double_rounding(actual, expected, normed):
    """The table's tolerance, plus what the intermediate rounding may add: the normalised heads
    are rounded to the dtype before the rotation (as the unfused norm stores them), and the
    kernel's and the reference's fp32 norms may round an element to neighbouring values. That is
    one unit in the last place of the normalised element, which the rotation carries into the
    output at up to |cos| + |sin| <= sqrt(2) times, even where the output is near zero: allow 1.5
    units of the largest normalised element of each head."""
    unit = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[actual.dtype]
    tolerance = TOLERANCES[actual.dtype]
    error = (actual.float() - expected.float()).abs()
    bound = tolerance.atol + tolerance.rtol * expected.float().abs()
    bound = bound + 1.5 * unit * normed.float().abs().amax(-1, keepdim=True)
    worst = (error - bound).max().item()
    assert worst <= 0, f"{(error > bound).sum().item()} elements beyond the bound, the worst by {worst:.3g}"


def check(tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, *, fused_qkv, offset):
    q, k, q_weight, k_weight, cos, sin, positions = make_inputs(
        tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, fused_qkv=fused_qkv
    )
    normed_q = rms_norm_ref(q, q_weight, 1e-6, offset=offset)
    normed_k = rms_norm_ref(k, k_weight, 1e-6, offset=offset)
    expected_q, expected_k = qk_norm_rope_ref(
        q.clone(), k.clone(), q_weight, k_weight, 1e-6, cos, sin, positions, offset=offset
    )
    returned = qk_norm_rope(q, k, q_weight, k_weight, 1e-6, cos, sin, positions, offset=offset)
    assert returned[0] is q and returned[1] is k, "qk_norm_rope works in place and returns its inputs"
    assert_close_after_double_rounding(q, expected_q, normed_q)
    assert_close_after_double_rounding(k, expected_k, normed_k)


CASES = dict(
    tokens=st.integers(1, 9),
    num_kv_heads=st.integers(1, 4),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([64, 128, 256, 6]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    fused_qkv=st.booleans(),
    offset=st.sampled_from([0.0, 1.0]),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CASES)
def test_interpreted_matches_reference(
    triton_on_cpu, tokens, num_kv_heads, group, head_dim, dtype, fused_qkv, offset
):
    check(
        tokens, num_kv_heads * group, num_kv_heads, head_dim, dtype, "cpu", fused_qkv=fused_qkv, offset=offset
    )


def test_interpreted_walks_more_heads_than_one_tile(triton_on_cpu):
    check(3, 40, 8, 256, torch.float32, "cpu", fused_qkv=True, offset=1.0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_two_ops_it_fuses(dtype, offset):
    """Each head normalised and rounded by `rms_norm`, then rotated by `rope`."""
    q, k, q_weight, k_weight, cos, sin, positions = make_inputs(5, 8, 2, 64, dtype, "cpu", fused_qkv=True)
    normed_q = rms_norm(q.clone(), q_weight, 1e-6, offset=offset)
    normed_k = rms_norm(k.clone(), k_weight, 1e-6, offset=offset)
    expected_q, expected_k = rope(normed_q, normed_k, cos, sin, positions)
    qk_norm_rope_ref(q, k, q_weight, k_weight, 1e-6, cos, sin, positions, offset=offset)
    assert_close(q, expected_q)
    assert_close(k, expected_k)


def test_interpreted_poisons_a_position_outside_the_table(triton_on_cpu):
    q, k, q_weight, k_weight, cos, sin, positions = make_inputs(
        3, 4, 2, 64, torch.float32, "cpu", fused_qkv=False
    )
    positions[1] = MAX_POSITIONS
    qk_norm_rope(q, k, q_weight, k_weight, 1e-6, cos, sin, positions)
    assert torch.isnan(q[1]).all() and torch.isnan(k[1]).all()
    assert not torch.isnan(q[[0, 2]]).any() and not torch.isnan(k[[0, 2]]).any()


def test_rejects_weights_of_another_head_dim():
    q, k, q_weight, k_weight, cos, sin, positions = make_inputs(
        2, 4, 2, 64, torch.float32, "cpu", fused_qkv=False
    )
    with pytest.raises(ValueError, match="q_weight and k_weight must be"):
        qk_norm_rope(q, k, q_weight[:32], k_weight, 1e-6, cos, sin, positions)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "tokens, heads, head_dim",
    [(1, (16, 8), 128), (7, (16, 8), 128), (1, (4, 1), 256), (300, (32, 8), 128), (5, (40, 8), 256)],
)
def test_cuda_matches_reference(cuda, tokens, heads, head_dim, dtype, offset):
    check(tokens, *heads, head_dim, dtype, cuda, fused_qkv=True, offset=offset)
