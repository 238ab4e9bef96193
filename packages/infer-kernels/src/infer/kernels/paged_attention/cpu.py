"""The CPU path of paged attention: `paged_attention_cpu` gathers each decode row's keys and runs
them through torch's fused SDPA (one call instead of the reference's dozen ops a row and layer,
which dominate a CPU decode step's attention), or hands the fp32 decode rows to
decode_attention_cpu.c (infer.kernels.cpu) in one call, and leaves extend rows to the reference.
"""

import ctypes

import torch
import torch.nn.functional as F

from infer.kernels.cpu.native import POINTER, SIZE, native_function
from infer.kernels.paged_attention.reference import paged_attention_ref


def paged_attention_cpu(
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
    decode_key_slots: tuple[torch.Tensor | range, ...] | None = None,
    native: bool = True,
    lookahead: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU path (same contract as paged_attention_ref). With `native`, decode rows in fp32 go
    to decode_attention_cpu.c, one C call for them all (`_decode_attention_native`), where it
    builds here (infer.kernels.cpu.native). Otherwise each decode row's keys (the last
    `sliding_window` of them with one) are gathered through its block table, or through
    `decode_key_slots[b]` (its keys' slots, made once for every layer) when given, and attended
    by `F.scaled_dot_product_attention`, which computes in fp32 for any input dtype. Extend rows
    go to the reference, with their `lookahead`.

    A row whose slots are a `range` (consecutive, as a lone sequence's blocks mostly are) is read
    through a view of the cache instead of a gathered copy: in SmolLM2's decode, with the cache
    cold after the layer's weights have streamed through it, that took a layer's attention at
    ~380 keys from 77 to 62 µs."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    num_rows = seq_lens.shape[0]
    if num_decode_rows < num_rows:  # the extend rows, through the reference (into `result`)
        bounds = query_start_loc[num_decode_rows:]
        start = int(bounds[0])
        paged_attention_ref(
            q[start:],
            k_cache,
            v_cache,
            query_start_loc=bounds - start,
            seq_lens=seq_lens[num_decode_rows:],
            block_tables=block_tables[num_decode_rows:],
            num_decode_rows=0,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            scale=scale,
            sliding_window=sliding_window,
            out=result[start:],
            lookahead=lookahead[start:] if lookahead is not None else None,
        )
    if (
        num_decode_rows
        and native
        and _decode_attention_native(
            q, k_cache, v_cache, result, seq_lens, block_tables, num_decode_rows, scale, sliding_window
        )
    ):
        return result
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    for b, seq_len in enumerate(seq_lens[:num_decode_rows].tolist()):
        first = 0 if sliding_window is None else max(seq_len - sliding_window, 0)
        if decode_key_slots is not None:
            slots = decode_key_slots[b][first:seq_len]
        else:
            positions = torch.arange(first, seq_len)
            slots = block_tables[b, positions // block_size].long() * block_size + positions % block_size
        if isinstance(slots, range):
            keys, values = k_flat[slots.start : slots.stop], v_flat[slots.start : slots.stop]
        else:
            keys, values = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
        # [1, heads, keys, D]; SDPA shares each KV head among its group of query heads.
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        row = F.scaled_dot_product_attention(
            q[b].view(1, num_q_heads, 1, head_dim),
            keys,
            values,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )
        result[b] = row.view(num_q_heads, head_dim)
    return result


# decode_attention_cpu.c keeps a head's output in a local buffer of this many floats (its
# MAX_HEAD_DIM); DecoderStackCpu, which includes that file, takes the same bound.
NATIVE_MAX_HEAD_DIM = 512
# decode_attention_cpu.c's entry point (the argument order of `paged_attention_cpu`'s call) -> status.
_DECODE_ATTENTION = (
    "decode_attention_cpu.c",
    "decode_attention",
    (POINTER, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER, POINTER, SIZE,
     SIZE, SIZE, SIZE, SIZE, SIZE, SIZE, ctypes.c_float, ctypes.c_int),
)  # fmt: skip


def _decode_attention_native(
    q, k_cache, v_cache, out, seq_lens, block_tables, num_rows, scale, sliding_window
) -> bool:
    """Rows [0, num_rows) of `out` by decode_attention_cpu.c, where it takes these tensors (fp32,
    each head's vector contiguous, int32 lengths and tables); whether it ran."""
    head_dim = q.shape[2]
    takes = (
        q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.float32
        and head_dim % 8 == 0
        and head_dim <= NATIVE_MAX_HEAD_DIM
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and out.stride(2) == 1
        and out.stride(1) == head_dim
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and seq_lens.dtype == block_tables.dtype == torch.int32
        and seq_lens.is_contiguous()
        and block_tables.stride(1) == 1
    )
    attend = native_function(*_DECODE_ATTENTION) if takes else None
    if attend is None:
        return False
    num_q_heads, (block_size, num_kv_heads) = q.shape[1], k_cache.shape[1:3]
    status = attend(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), num_rows, num_q_heads, num_kv_heads, head_dim, block_size,
        sliding_window or 0, scale, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("decode_attention_cpu could not allocate a row's scores")
    return True
