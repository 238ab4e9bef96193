"""store_kv at Llama 3.2 1B shapes (8 kv heads, head_dim 64, bf16) into a paged cache of 16-key
blocks, k/v as views of a fused projection output: Triton vs eager reference vs torch.compile."""

import pytest
import torch
from harness import DECODE_TOKENS, DTYPE, IMPLS, PREFILL_TOKENS, Case, gpu_tensor

from infer.kernels import store_kv, store_kv_ref

NUM_KV_HEADS, HEAD_DIM = 8, 64
BLOCK_SIZE = 16
NUM_BLOCKS = 4096  # 65536 slots


def make_inputs(tokens: int) -> tuple:
    kv = gpu_tensor(tokens, 2, NUM_KV_HEADS, HEAD_DIM)
    k_cache = gpu_tensor(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = gpu_tensor(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:tokens]
    return kv[:, 0], kv[:, 1], k_cache, v_cache, slot_mapping


def cases() -> list[Case]:
    out = []
    for tokens in DECODE_TOKENS + PREFILL_TOKENS:
        kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        out.append(
            Case(
                op="store_kv",
                shape=f"{tokens} tok, {NUM_KV_HEADS}kv x {HEAD_DIM}",
                tokens=tokens,
                bytes_moved=2 * kv_bytes + tokens * 8,  # k, v read and written, slots read
                make_inputs=lambda t=tokens: make_inputs(t),
                triton_fn=store_kv,
                eager_fn=store_kv_ref,
            )
        )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_store_kv(bench_op, case, impl):
    bench_op(case, impl)
