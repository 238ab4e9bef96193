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
# Decode as a server runs it (W2 at 64): row lengths drawn from 300..1300 keys, the launch sized
# by a CUDA graph for the model's longest row (4096), far above every row.
RAGGED_DECODE = (64, (300, 1300), 4096)


def make_inputs(
    num_rows: int, query_len: int, seq_len: int, row_lens: list[int] | None = None, bound=None
) -> tuple:
    """`row_lens` (decode only): each row's own key count, at most seq_len; `bound`: the
    max_seq_len the launch is sized for (default seq_len)."""
    row_lens = row_lens or [seq_len] * num_rows
    blocks_per_row = math.ceil((bound or seq_len) / BLOCK_SIZE)
    num_blocks = num_rows * blocks_per_row
    k_cache = gpu_tensor(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = gpu_tensor(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = torch.randperm(num_blocks, device="cuda").view(num_rows, blocks_per_row).int()
    q = gpu_tensor(num_rows * query_len, NUM_Q_HEADS, HEAD_DIM)
    meta = dict(
        query_start_loc=torch.arange(num_rows + 1, device="cuda", dtype=torch.int32) * query_len,
        seq_lens=torch.tensor(row_lens, device="cuda", dtype=torch.int32),
        block_tables=block_tables,
        num_decode_rows=num_rows if query_len == 1 else 0,
        max_query_len=query_len,
        max_seq_len=bound or seq_len,
        scale=1 / math.sqrt(HEAD_DIM),
    )

    # The baseline's inputs: the same keys and values, contiguous per row, [B, Hkv, S, D], and
    # for ragged rows a mask of each row's keys.
    def contiguous(cache):
        rows = cache[block_tables.long()].view(num_rows, blocks_per_row * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        return rows[:, :seq_len].transpose(1, 2).contiguous()

    sdpa_q = q.view(num_rows, query_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    key_mask = None
    if len(set(row_lens)) > 1:
        key_mask = (torch.arange(seq_len, device="cuda")[None, :] < meta["seq_lens"][:, None])[
            :, None, None, :
        ]
    return q, k_cache, v_cache, meta, key_mask, sdpa_q, contiguous(k_cache), contiguous(v_cache)


def paged(q, k_cache, v_cache, meta, *_baseline_inputs):
    return paged_attention(q, k_cache, v_cache, **meta)


def sdpa(*inputs):
    key_mask, q, k, v = inputs[-4:]
    query_len, seq_len = q.shape[2], k.shape[2]
    mask = causal_lower_right(query_len, seq_len) if query_len > 1 else key_mask
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _case(num_rows, query_len, seq_len, label, make) -> Case:
    tokens = num_rows * query_len
    kv_bytes = 2 * seq_len * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # seq_len: keys of all rows
    q_bytes = tokens * NUM_Q_HEADS * HEAD_DIM * DTYPE.itemsize
    kind = "decode" if query_len == 1 else f"extend {query_len} tok"
    heads = f"{NUM_Q_HEADS}q/{NUM_KV_HEADS}kv x {HEAD_DIM}"
    return Case(
        op="paged_attention",
        shape=f"{kind} x {num_rows} rows, {label}, {heads}",
        tokens=tokens,
        bytes_moved=kv_bytes + 2 * q_bytes,  # keys and values once, q read, out written
        make_inputs=make,
        triton_fn=paged,
        eager_fn=sdpa,
    )


def cases() -> list[Case]:
    shapes = [(batch, 1, context) for batch in DECODE_BATCHES for context in DECODE_CONTEXTS]
    out = [
        _case(r, q, r * s, f"{s} keys", lambda r=r, q=q, s=s: make_inputs(r, q, s))
        for r, q, s in shapes + EXTEND_SHAPES
    ]
    num_rows, (low, high), bound = RAGGED_DECODE
    row_lens = torch.randint(low, high + 1, (num_rows,), generator=torch.Generator().manual_seed(0)).tolist()
    out.append(
        _case(
            num_rows,
            1,
            sum(row_lens),
            f"{low}-{high} keys (launch for {bound})",
            lambda: make_inputs(num_rows, 1, max(row_lens), row_lens, bound),
        )
    )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_paged_attention(bench_op, case, impl):
    bench_op(case, impl)
