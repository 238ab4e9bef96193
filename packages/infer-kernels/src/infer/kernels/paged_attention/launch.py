"""`paged_attention`: checks its inputs and launches the decode kernels on the decode rows and the
extend kernel on the prompt chunks (decode.py, extend.py), or takes the CPU path (cpu.py) or the
reference (reference.py) where Triton does not run.
"""

import torch
import triton

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.kv_fp8 import is_fp8
from infer.kernels.paged_attention.cpu import paged_attention_cpu
from infer.kernels.paged_attention.decode import _launch_decode
from infer.kernels.paged_attention.extend import _launch_extend
from infer.kernels.paged_attention.reference import paged_attention_ref
from infer.kernels.paged_attention.tiles import _MIN_DOT, _dot_precision
from infer.kernels.store_kv import check_fp8_scales

# An fp8 cache's decode is bound by the work a key takes, not by its bytes: its dots run in
# fp16 (k and v converted from e4m3 in one instruction a pair, q from bf16 exactly), and a loop
# step takes 16 KiB of keys (128 of 128 dims) rather than bf16's 32 keys. At llama-3.1-8b's heads,
# 64 rows, on an H200 that took fp8's decode attention from 1.32x to 1.12x bf16's time at 1,024
# keys a row and from 1.45x to 1.12x at 16,384 (docs/benchmarks/kv-cache.md#fp8-decode-attention);
# other head sizes take the same bytes a step, unmeasured.
_FP8_F16_DOTS = True


def paged_attention(
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
    pdl: bool = False,
    lookahead: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[N, Hq, D]`, the tokens of B rows back to back (`query_start_loc` `[B+1]`), against
    each row's keys 0..seq_lens[b]-1 in the caches `[num_blocks, block_size, Hkv, D]` through
    `block_tables` `[B, max_blocks]`: causal, and within `sliding_window` if given. Rows
    0..num_decode_rows-1 hold one token each. Returns `[N, Hq, D]` in q's dtype (`out` if given).

    `lookahead` (int32 `[N]`, indexed as q): query token t sees keys up to `position(t) +
    lookahead[t]`, so that an image's tokens attend to each other both ways: 0 for text, and
    `last position of its image - position(t)` for an image's tokens. The window stays relative
    to position(t) (keep an image no longer than it). Decode rows ignore it: theirs is 0 (a
    decoded token is text), and their one query is the row's last key anyway. Keep `position +
    lookahead < seq_lens[b]` on extend rows: read on the device, it is not checked.

    `max_query_len` and `max_seq_len` are host bounds on the rows' query and key counts (launch
    sizes only). The lengths and block ids themselves are read on the device (no host sync), so
    they are not checked: keep `q_len_b <= seq_lens[b] <= max_seq_len`, `q_len_b <=
    max_query_len` and every block id in range.

    `extend_tiles` (int32 `[2, S]`, for CUDA graphs): the extend rows' launch plan, slot s
    serving tile `extend_tiles[1, s]` (of `extend_tile_size(D)` queries) of row
    `extend_tiles[0, s]` (an absolute row, -1 for none); it must name every tile of every extend
    row once. None: the grid covers every extend row up to max_query_len.

    `decode_key_slots` (CPU only, else ignored): each decode row's key slots, int64 `[seq_lens[b]]`
    or a `range` where they are consecutive (AttentionMetadata.decode_key_slots), which the CPU
    path's SDPA reads instead of the block table. They must be the table's slots: the CPU's C
    kernel reads the table. `native` (CPU only): decode rows may take decode_attention_cpu.c
    (`paged_attention_cpu`). `pdl` (CUDA): launch with programmatic dependent launch
    (infer.kernels.pdl).

    float8_e4m3fn caches (infer.kernels.kv_fp8, as `store_kv` writes them) come with their scale
    bytes `k_scales`, `v_scales` (uint8 `[num_blocks, block_size, Hkv]`); q and the output stay
    in their own dtype. On a CPU they take the reference.
    """
    kwargs = dict(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_decode_rows=num_decode_rows,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        scale=scale,
        sliding_window=sliding_window,
        extend_tiles=extend_tiles,
        lookahead=lookahead,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    _check(q, k_cache, v_cache, out, **kwargs)
    if not use_triton(q):
        if q.device.type == "cpu" and k_scales is None:
            del kwargs["k_scales"], kwargs["v_scales"]
            return paged_attention_cpu(
                q, k_cache, v_cache, out=out, decode_key_slots=decode_key_slots, native=native, **kwargs
            )
        return paged_attention_ref(q, k_cache, v_cache, out=out, **kwargs)
    if q.stride(-1) != 1:
        q = q.contiguous()  # read only: a copy changes nothing the caller sees
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kwargs["block_tables"] = block_tables.contiguous()
    _launch(q, k_cache, v_cache, out, pdl=pdl, **kwargs)
    return out


def _launch(
    q,
    k_cache,
    v_cache,
    out,
    *,
    query_start_loc,
    seq_lens,
    block_tables,
    num_decode_rows,
    max_query_len,
    max_seq_len,
    scale,
    sliding_window,
    extend_tiles,
    lookahead,
    k_scales,
    v_scales,
    pdl,
) -> None:
    """The decode kernels on rows 0..num_decode_rows-1 and the extend kernel on the rest, with the
    arguments they share."""
    num_tokens, head_dim = q.shape[0], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    fp8 = k_scales is not None
    common = dict(
        # Any pointer without scales: the kernels do not read them then.
        k_scale_ptr=k_scales if fp8 else k_cache,
        v_scale_ptr=v_scales if fp8 else v_cache,
        num_kv_heads=num_kv_heads,
        FP8=fp8,
        # fp16 dots only on CUDA (the interpreter takes the fp32 paths, as for NATIVE_QK).
        F16=fp8 and _FP8_F16_DOTS and q.is_cuda,
        k_stride_slot=k_cache.stride(1),
        k_stride_head=k_cache.stride(2),
        v_stride_slot=v_cache.stride(1),
        v_stride_head=v_cache.stride(2),
        out_stride_token=out.stride(0),
        out_stride_head=out.stride(1),
        block_table_stride=block_tables.stride(0),
        sliding_window=sliding_window or 0,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    seq_lens = seq_lens.contiguous()
    if num_decode_rows:
        _launch_decode(
            q,
            k_cache,
            v_cache,
            out,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decode_rows=num_decode_rows,
            max_seq_len=max_seq_len,
            scale=scale,
            common=common,
            pdl=pdl,
        )
    if seq_lens.shape[0] > num_decode_rows and num_tokens > num_decode_rows:
        _launch_extend(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decode_rows=num_decode_rows,
            max_query_len=max_query_len,
            extend_tiles=extend_tiles,
            lookahead=lookahead,
            scale=scale,
            common=common,
            pdl=pdl,
        )


def _check(
    q,
    k_cache,
    v_cache,
    out,
    *,
    query_start_loc,
    seq_lens,
    block_tables,
    num_decode_rows,
    max_query_len,
    max_seq_len,
    scale,
    sliding_window,
    extend_tiles,
    lookahead,
    k_scales,
    v_scales,
) -> None:
    check_dtype("q", q)
    if not is_fp8(k_cache.dtype):
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_dtype(name, t)
    check_fp8_scales(k_cache, v_cache, k_scales, v_scales)
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc)
    tensors.update(seq_lens=seq_lens, block_tables=block_tables)
    if out is not None:
        tensors["out"] = out
    if extend_tiles is not None:
        tensors["extend_tiles"] = extend_tiles
        if extend_tiles.dim() != 2 or extend_tiles.shape[0] != 2 or extend_tiles.dtype != torch.int32:
            raise ValueError(
                f"extend_tiles must be an int32 tensor [2, slots] (rows, tiles), "
                f"got {extend_tiles.dtype} {tuple(extend_tiles.shape)}"
            )
    if lookahead is not None:
        tensors["lookahead"] = lookahead
        if lookahead.shape != q.shape[:1] or lookahead.dtype != torch.int32:
            raise ValueError(
                f"lookahead must be an int32 tensor [{q.shape[0]}], one per query token as q, "
                f"got {lookahead.dtype} {tuple(lookahead.shape)}"
            )
    check_same_device(**tensors)
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [N, q_heads, head_dim] and k_cache [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if (
        v_cache.shape != k_cache.shape
        or v_cache.dtype != k_cache.dtype
        or (q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype))
    ):
        raise ValueError(
            f"k_cache and v_cache must match each other and q's dtype (or be fp8): {tuple(k_cache.shape)} "
            f"{k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}, q {q.dtype}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q's head_dim must equal the cache's and its heads be a multiple of the KV heads: "
            f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous (a key's address is its flat slot)")
    num_rows = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_rows,)),
        ("query_start_loc", query_start_loc, (num_rows + 1,)),
    ):
        if t.dim() != 1 or t.shape != shape or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be an int32 tensor of shape {shape} (B = rows), got {t.dtype} {tuple(t.shape)}"
            )
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_rows
        or block_tables.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"block_tables must be an int32 tensor of shape ({num_rows}, max_blocks), "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if block_tables.shape[1] * k_cache.shape[1] < max_seq_len:
        raise ValueError(
            f"block_tables holds {block_tables.shape[1]} blocks of {k_cache.shape[1]} keys, fewer than "
            f"max_seq_len={max_seq_len}; give each row enough blocks for the longest row"
        )
    if not 0 <= num_decode_rows <= num_rows or num_decode_rows > q.shape[0]:
        raise ValueError(f"num_decode_rows must be in 0..{min(num_rows, q.shape[0])}, got {num_decode_rows}")
    if max_query_len < 0 or max_seq_len < 0:
        raise ValueError(f"max_query_len and max_seq_len must be >= 0, got {max_query_len} and {max_seq_len}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(
            f"out must be a {tuple(q.shape)} {q.dtype} tensor contiguous in head_dim, "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
