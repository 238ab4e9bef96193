"""qk_norm_rope (Qwen 3's per-head RMSNorm of q and k, then rope) on q/k views of a fused qkv
output (32 q heads, 8 kv heads, head_dim 128), bf16, fp32 tables gathered by positions: Triton
vs eager reference vs torch.compile. The unfused path it replaces is two `rms_norm` launches and
one `rope` (bench_rms_norm, bench_rope)."""

import pytest
import torch
from harness import DECODE_TOKENS, DTYPE, IMPLS, PREFILL_TOKENS, Case, gpu_tensor

from infer.kernels import qk_norm_rope, qk_norm_rope_ref, rope_tables

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
MAX_POSITIONS = 32768


def make_inputs(tokens: int) -> tuple:
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = gpu_tensor(tokens, q_size + 2 * kv_size)
    q = qkv[:, :q_size].view(tokens, NUM_Q_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, NUM_KV_HEADS, HEAD_DIM)
    q_weight, k_weight = gpu_tensor(HEAD_DIM), gpu_tensor(HEAD_DIM)
    cos, sin = rope_tables(HEAD_DIM, MAX_POSITIONS, 1e6, device="cuda")
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), device="cuda")
    return q, k, q_weight, k_weight, 1e-6, cos, sin, positions


def cases() -> list[Case]:
    out = []
    for tokens in DECODE_TOKENS + PREFILL_TOKENS:
        qk_bytes = tokens * (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM * DTYPE.itemsize
        table_bytes = tokens * 2 * (HEAD_DIM // 2) * 4 + tokens * 8  # cos + sin rows, positions
        out.append(
            Case(
                op="qk_norm_rope",
                shape=f"{tokens} tok, {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv x {HEAD_DIM}",
                tokens=tokens,
                bytes_moved=2 * qk_bytes + table_bytes,  # q, k read and written in place
                make_inputs=lambda t=tokens: make_inputs(t),
                triton_fn=qk_norm_rope,
                eager_fn=qk_norm_rope_ref,
            )
        )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_qk_norm_rope(bench_op, case, impl):
    bench_op(case, impl)
