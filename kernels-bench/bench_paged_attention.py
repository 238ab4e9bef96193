"""paged_attention at Llama 3.2 1B shapes (32 q heads, 8 kv heads, head_dim 64, bf16, blocks of
16 keys in random order): decode (batch 1/16/64 x 1024/4096 keys) and extend (4 rows x 512-token
chunks over 2048-key prefixes; one 4096-token prompt with no prefix).

The "eager" and "compile" columns are torch SDPA (flash / memory-efficient backends, GQA via
enable_gqa) on the same shapes with each row's K/V already contiguous, `[B, Hkv, S, D]`: the
attention a model with a contiguous cache would run, which does not pay for the block-table
gather. (paged_attention_ref, the CPU path, is no baseline: it loops over rows on the host.)
GB/s counts q, the output and each row's keys and values read once.
"""

import math

import pytest
import torch
from harness import DTYPE, IMPLS, Case, gpu_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from infer.kernels import paged_attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 64
BLOCK_SIZE = 16
DECODE_BATCHES = [1, 16, 64]
DECODE_CONTEXTS = [1024, 4096]
# (rows, query tokens per row, keys per row once written)
EXTEND_SHAPES = [(4, 512, 2560), (1, 4096, 4096)]


def make_inputs(num_rows: int, query_len: int, seq_len: int) -> tuple:
    blocks_per_row = math.ceil(seq_len / BLOCK_SIZE)
    num_blocks = num_rows * blocks_per_row
    k_cache = gpu_tensor(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = gpu_tensor(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = torch.randperm(num_blocks, device="cuda").view(num_rows, blocks_per_row).int()
    q = gpu_tensor(num_rows * query_len, NUM_Q_HEADS, HEAD_DIM)
    meta = dict(
        query_start_loc=torch.arange(num_rows + 1, device="cuda", dtype=torch.int32) * query_len,
        seq_lens=torch.full((num_rows,), seq_len, device="cuda", dtype=torch.int32),
        block_tables=block_tables,
        num_decode_rows=num_rows if query_len == 1 else 0,
        max_query_len=query_len,
        max_seq_len=seq_len,
        scale=1 / math.sqrt(HEAD_DIM),
    )

    # The baseline's inputs: the same keys and values, contiguous per row, [B, Hkv, S, D].
    def contiguous(cache):
        rows = cache[block_tables.long()].view(num_rows, blocks_per_row * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        return rows[:, :seq_len].transpose(1, 2).contiguous()

    sdpa_q = q.view(num_rows, query_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return q, k_cache, v_cache, meta, sdpa_q, contiguous(k_cache), contiguous(v_cache)


def paged(q, k_cache, v_cache, meta, *_baseline_inputs):
    return paged_attention(q, k_cache, v_cache, **meta)


def sdpa(*inputs):
    q, k, v = inputs[-3:]
    query_len, seq_len = q.shape[2], k.shape[2]
    mask = causal_lower_right(query_len, seq_len) if query_len > 1 else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def cases() -> list[Case]:
    shapes = [(batch, 1, context) for batch in DECODE_BATCHES for context in DECODE_CONTEXTS]
    out = []
    for num_rows, query_len, seq_len in shapes + EXTEND_SHAPES:
        tokens = num_rows * query_len
        kv_bytes = 2 * num_rows * seq_len * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        q_bytes = tokens * NUM_Q_HEADS * HEAD_DIM * DTYPE.itemsize
        kind = "decode" if query_len == 1 else f"extend {query_len} tok"
        heads = f"{NUM_Q_HEADS}q/{NUM_KV_HEADS}kv x {HEAD_DIM}"
        out.append(
            Case(
                op="paged_attention",
                shape=f"{kind} x {num_rows} rows, {seq_len} keys, {heads}",
                tokens=tokens,
                bytes_moved=kv_bytes + 2 * q_bytes,  # keys and values once, q read, out written
                make_inputs=lambda r=num_rows, q=query_len, s=seq_len: make_inputs(r, q, s),
                triton_fn=paged,
                eager_fn=sdpa,
            )
        )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_paged_attention(bench_op, case, impl):
    bench_op(case, impl)
