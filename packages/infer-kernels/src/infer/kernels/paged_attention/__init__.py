"""Attention of a flat batch of rows (decodes, then prompt chunks) over a block-structured KV cache.

The batch is infer.models' ForwardBatch: N query tokens of B rows back to back, row b's tokens
at `query_start_loc[b]:query_start_loc[b+1]`. They are the last tokens of row b's sequence,
which has `seq_lens[b]` keys once this step's are written (store_kv), so its query i sits at
position `seq_lens[b] - q_len_b + i` and sees keys up to that position (and, with a sliding
window W, only the last W of them). An image's tokens (Gemma 3's) attend to each other both
ways: `lookahead[t]` lets query t of an extend row see keys up to its position plus that many
(up to its image's last token; 0 for text); the window stays relative to its own position (an
image is no longer than the window, so it keeps the image's first tokens). Key j of row b is at
flat slot `block_tables[b, j // block_size] * block_size + j % block_size` of the cache
`[num_blocks, block_size, num_kv_heads, head_dim]`; block_size is any positive integer (the
contiguous pool uses one block of max_seq_len per row), so each key's address is computed alone.

The modules, one a path:
- `launch`: `paged_attention`, which checks its inputs and picks the path;
- `decode`: the decode rows (one query each), flash-decoding in splits and their merge;
- `extend`: the extend rows (prompt chunks), flash attention over key tiles;
- `tiles`: what the two kernels share (a key tile's slots and scales, its dots);
- `cpu`: `paged_attention_cpu`, SDPA or decode_attention_cpu.c for the decode rows on a CPU;
- `reference`: `paged_attention_ref`, plain PyTorch, the oracle and the CPU path of the rest.
"""

from infer.kernels.paged_attention.cpu import NATIVE_MAX_HEAD_DIM, paged_attention_cpu
from infer.kernels.paged_attention.decode import decode_num_splits, decode_warm_up_lengths
from infer.kernels.paged_attention.extend import extend_tile_size
from infer.kernels.paged_attention.launch import paged_attention
from infer.kernels.paged_attention.reference import paged_attention_ref

__all__ = [
    "NATIVE_MAX_HEAD_DIM",
    "decode_num_splits",
    "decode_warm_up_lengths",
    "extend_tile_size",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_ref",
]
