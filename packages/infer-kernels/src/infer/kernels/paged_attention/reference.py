"""`paged_attention_ref`: the reference of paged attention in plain PyTorch, the tests' oracle and
the CPU path of the rows `paged_attention_cpu` leaves to it (extend rows, fp8 caches).
"""

import torch

from infer.kernels.kv_fp8 import dequantize_fp8_ref


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_decode_rows: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    extend_tiles: torch.Tensor | None = None,
    lookahead: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference (and CPU path): per row, gather its keys through the block table and run one
    grouped matmul over all its queries, masked softmax in fp32. Reads lengths on the host, so
    `extend_tiles` (a launch plan) changes nothing here. An fp8 cache's keys and values are
    dequantized with their scales (kv_fp8.dequantize_fp8_ref) once gathered."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    bounds = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        query_len = end - start
        if query_len == 0:
            continue
        key_positions = torch.arange(seq_len, device=q.device)
        # Exactly the row's keys (a contiguous pool's one block may be far longer than the row).
        slots = block_tables[b, key_positions // block_size].long() * block_size + key_positions % block_size
        keys = _gather(k_flat, k_scales, slots)  # [S, Hkv, D] fp32
        values = _gather(v_flat, v_scales, slots)
        # [Hkv, G * L, D]: the group's query heads and the row's queries share one matmul.
        grouped_q = q[start:end].float().view(query_len, num_kv_heads, group, head_dim)
        grouped_q = grouped_q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * query_len, head_dim)
        scores = torch.matmul(grouped_q, keys.permute(1, 2, 0)) * scale  # [Hkv, G * L, S]
        positions = key_positions[seq_len - query_len :]
        # A decode row's one query is its last key: a lookahead there reaches no key.
        sees_up_to = positions if lookahead is None else positions + lookahead[start:end]
        visible = key_positions[None, :] <= sees_up_to[:, None]  # [L, S]
        if sliding_window is not None:
            visible &= key_positions[None, :] > positions[:, None] - sliding_window
        scores = scores.view(num_kv_heads, group, query_len, seq_len).masked_fill(~visible, float("-inf"))
        rows_out = torch.matmul(scores.softmax(dim=-1), values.transpose(0, 1)[:, None])  # [Hkv, G, L, D]
        result[start:end] = rows_out.permute(2, 0, 1, 3).reshape(query_len, num_q_heads, head_dim).to(q.dtype)
    return result


def _gather(flat_cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows at `slots`, in fp32 (an fp8 cache's with the scales of those slots)."""
    rows = flat_cache.index_select(0, slots)
    if scales is None:
        return rows.float()
    row_scales = scales.view(-1, flat_cache.shape[1]).index_select(0, slots)
    return dequantize_fp8_ref(rows, row_scales, torch.float32)
