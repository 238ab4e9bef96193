"""rope against its PyTorch reference, on contiguous q/k and on views of a fused qkv output."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import assert_close, rope, rope_ref, rope_tables

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_POSITIONS = 4096


def make_qk(batch, tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, *, fused_qkv):
    """q and k as [T, H, D] (batch None) or [B, T, H, D]; views into one qkv tensor if fused_qkv."""
    gen = torch.Generator().manual_seed(tokens * 7 + head_dim)
    leading = (tokens,) if batch is None else (batch, tokens)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if fused_qkv:  # the models' layout: qkv = x @ w_qkv, then views of it
        qkv = torch.randn(*leading, q_size + 2 * kv_size, generator=gen).to(device, dtype)
        q = qkv[..., :q_size].view(*leading, num_q_heads, head_dim)
        k = qkv[..., q_size : q_size + kv_size].view(*leading, num_kv_heads, head_dim)
        return q, k
    q = torch.randn(*leading, num_q_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(*leading, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    return q, k


def check_rope(batch, tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, *, fused_qkv, per_token):
    q, k = make_qk(batch, tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, fused_qkv=fused_qkv)
    cos, sin = rope_tables(head_dim, MAX_POSITIONS, 10000.0, device=device)
    leading = q.shape[:-2]
    # Mixed batch: every token has its own position, in no particular order.
    positions = torch.randint(0, MAX_POSITIONS, leading, generator=torch.Generator().manual_seed(1)).to(
        device
    )
    if per_token:
        cos, sin, positions = cos[positions], sin[positions], None
    expected_q, expected_k = rope_ref(q.clone(), k.clone(), cos, sin, positions)
    returned_q, returned_k = rope(q, k, cos, sin, positions)
    assert returned_q is q and returned_k is k, "rope must rotate in place and return its inputs"
    assert_close(q, expected_q)
    assert_close(k, expected_k)


# Token layouts, GQA groups and head dims (Gemma's 256, and 6 below any tile) of the checks below.
ROPE_CASES = dict(
    batch=st.sampled_from([None, 1, 3]),
    tokens=st.integers(1, 17),
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 80, 96, 128, 256, 6]),
    dtype=st.sampled_from(DTYPES),
    fused_qkv=st.booleans(),
    per_token=st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(**ROPE_CASES)
def test_rope_cpu_path_matches_reference(
    batch, tokens, num_kv_heads, group, head_dim, dtype, fused_qkv, per_token
):
    """A CPU tensor takes rope_cpu (fp32: its own ops; other dtypes: the reference)."""
    args = (batch, tokens, num_kv_heads * group, num_kv_heads, head_dim, dtype, "cpu")
    check_rope(*args, fused_qkv=fused_qkv, per_token=per_token)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**ROPE_CASES)
def test_rope_interpreted_matches_reference(
    triton_on_cpu, batch, tokens, num_kv_heads, group, head_dim, dtype, fused_qkv, per_token
):
    check_rope(
        batch,
        tokens,
        num_kv_heads * group,
        num_kv_heads,
        head_dim,
        dtype,
        "cpu",
        fused_qkv=fused_qkv,
        per_token=per_token,
    )


def test_rope_interpreted_handles_more_heads_than_one_tile(triton_on_cpu):
    # 64 heads x 128 dims exceed one program's tile: the kernel walks the heads in a loop.
    check_rope(None, 3, 64, 8, 128, torch.float32, "cpu", fused_qkv=True, per_token=False)


def test_rope_interpreted_poisons_a_position_outside_the_table(triton_on_cpu):
    q, k = make_qk(None, 3, 2, 1, 64, torch.float32, "cpu", fused_qkv=False)
    cos, sin = rope_tables(64, 16, 10000.0)
    rope(q, k, cos, sin, torch.tensor([0, 16, 5]))
    assert q[1].isnan().all() and k[1].isnan().all(), "out-of-table token must become NaN, not garbage"
    assert not q[[0, 2]].isnan().any(), "in-table tokens must be rotated normally"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(
    "batch,tokens", [(None, 1), (None, 37), (None, 4096), (4, 1), (2, 1000)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("heads", [(32, 8), (9, 3), (14, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("layout", ["fused_qkv", "contiguous", "per_token"])
def test_rope_cuda_matches_reference(cuda, layout, heads, batch, tokens, head_dim, dtype):
    check_rope(
        batch,
        tokens,
        *heads,
        head_dim,
        dtype,
        cuda,
        fused_qkv=layout == "fused_qkv",
        per_token=layout == "per_token",
    )


def test_rope_rejects_q_with_a_strided_head_dim():
    q = torch.randn(4, 2, 128)[..., ::2]  # [4, 2, 64], stride 2 in the head dim
    k = torch.randn(4, 1, 64)
    cos, sin = rope_tables(64, 8, 10000.0)
    with pytest.raises(ValueError, match="q must have a contiguous head dim"):
        rope(q, k, cos, sin, torch.zeros(4, dtype=torch.long))


def test_rope_rejects_positions_of_the_wrong_shape():
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    cos, sin = rope_tables(64, 8, 10000.0)
    with pytest.raises(ValueError, match="positions must be int32/int64 with shape \\[4\\]"):
        rope(q, k, cos, sin, torch.zeros(3, dtype=torch.long))


def test_rope_rejects_tables_for_another_head_dim():
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    cos, sin = rope_tables(128, 8, 10000.0)
    with pytest.raises(ValueError, match="cos and sin must share a shape ending in head_dim // 2 = 32"):
        rope(q, k, cos, sin, torch.zeros(4, dtype=torch.long))


def test_rope_rejects_q_without_a_head_axis():
    q, k = torch.randn(4, 64), torch.randn(4, 64)
    cos, sin = rope_tables(64, 8, 10000.0)
    with pytest.raises(ValueError, match="q must be \\[T, H, D\\] or \\[B, T, H, D\\]"):
        rope(q, k, cos, sin, torch.zeros(4, dtype=torch.long))
