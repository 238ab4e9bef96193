"""The extend rows' attention (prompt chunks): flash attention, one program per (tile of BLOCK_M
queries of one row, query head), over key tiles up to the tile's last position, with causal and
sliding-window masks and an online softmax.

With `lookahead` (a variant of its own: batches without images run the kernel as before) the key
tiles run up to the furthest key any query of the tile sees, as a tile may end inside an image
whose last token lies in a later tile. The grid is made of host ints: (tiles of max_query_len,
extend rows, heads); tiles past a row's length exit. A CUDA graph that replays for any mix of
prompt chunks passes `extend_tiles` instead, a device map of (row, tile) per program
(`extend_tile_size` queries a tile) whose grid is the map's length: the graph fixes only how
many tiles fit.
"""

import torch
import triton
import triton.language as tl

from infer.kernels.paged_attention.tiles import _MIN_DOT, _key_scales, _key_slots, _scores, _weighted_values
from infer.kernels.pdl import await_inputs, launch_options

# Extend (BLOCK_M queries, BLOCK_N keys, warps, stages) for head_dim <= 128, the fastest of a
# sweep on an H100 (Llama 3.2 1B heads, bf16): about 1.7x the time of torch's flash SDPA on
# contiguous K/V, against 3x for 64/64/4 warps.
_EXTEND_CONFIG = (128, 64, 8, 2)


@triton.jit(do_not_specialize=["block_table_stride", "first_row"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    query_start_ptr,
    seq_len_ptr,
    block_table_ptr,
    q_stride_token,
    q_stride_head,
    k_scale_ptr,
    v_scale_ptr,
    k_stride_slot,
    k_stride_head,
    v_stride_slot,
    v_stride_head,
    out_stride_token,
    out_stride_head,
    block_table_stride,
    first_row,
    tile_map_ptr,
    lookahead_ptr,
    scale,
    sliding_window,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_LOOKAHEAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_QK: tl.constexpr,
    USE_TILE_MAP: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row, tile, has_tile = _program_tile(tile_map_ptr, first_row, USE_TILE_MAP)
    head = tl.program_id(2).to(tl.int64)
    query_start = tl.load(query_start_ptr + row).to(tl.int64)
    query_len = (tl.load(query_start_ptr + row + 1) - query_start).to(tl.int32)
    if has_tile & (tile * BLOCK_M < query_len):
        seq_len = tl.load(seq_len_ptr + row).to(tl.int32)
        queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        query_mask = queries < query_len
        positions = seq_len - query_len + queries  # [BLOCK_M]
        dims = tl.arange(0, DIM_PAD)
        dim_mask = dims < HEAD_DIM
        tokens = query_start + queries
        q = tl.load(
            q_ptr + tokens[:, None] * q_stride_token + head * q_stride_head + dims[None, :],
            mask=query_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if not NATIVE_QK:
            q = q.to(tl.float32)

        last_position = seq_len - query_len + tl.minimum(tile * BLOCK_M + BLOCK_M, query_len) - 1
        last_key = last_position
        sees_up_to = positions  # each query's furthest key, further with HAS_LOOKAHEAD
        if HAS_LOOKAHEAD:
            ahead = tl.load(lookahead_ptr + tokens, mask=query_mask, other=0)
            sees_up_to = positions + ahead  # [BLOCK_M]
            # A tile may end inside an image whose last token lies in a later tile: its queries see
            # up to there, so the loop runs to the furthest key any of the tile's queries sees.
            last_key = tl.max(tl.where(query_mask, sees_up_to, last_position), 0)
        start = 0
        if HAS_WINDOW:
            start = (
                tl.maximum(seq_len - query_len + tile * BLOCK_M - sliding_window + 1, 0) // BLOCK_N
            ) * BLOCK_N
        table_row = block_table_ptr + row * block_table_stride
        kv_head = head // GROUP
        k_base = k_ptr + kv_head * k_stride_head
        v_base = v_ptr + kv_head * v_stride_head
        k_scale_base = k_scale_ptr + kv_head
        v_scale_base = v_scale_ptr + kv_head

        denominator, acc = _attend_keys(
            q, positions, sees_up_to, start, last_key, table_row, k_base, v_base, k_scale_base, v_scale_base,
            k_stride_slot, v_stride_slot, dims, dim_mask, num_kv_heads, sliding_window, scale, BLOCK_M,
            BLOCK_N, DIM_PAD, BLOCK_SIZE, HAS_WINDOW, HAS_LOOKAHEAD, DOT_PRECISION, NATIVE_QK, FP8, F16,
        )  # fmt: skip
        # Padded query rows (past the row's end) saw nothing: divide by 1, they are not stored.
        denominator = tl.where(query_mask, denominator, 1.0)
        tl.store(
            out_ptr + tokens[:, None] * out_stride_token + head * out_stride_head + dims[None, :],
            (acc / denominator[:, None]).to(out_ptr.dtype.element_ty),
            mask=query_mask[:, None] & dim_mask[None, :],
        )


@triton.jit
def _program_tile(tile_map_ptr, first_row, USE_TILE_MAP: tl.constexpr):
    """(row, tile of that row, whether there is one) that this program serves: the map's slot
    p with USE_TILE_MAP, else the grid's tile and extend row."""
    if USE_TILE_MAP:
        # Program p serves the tile the map names in slot p: (row, tile of that row); an empty
        # slot has row -1.
        mapped_row = tl.load(tile_map_ptr + tl.program_id(0))
        tile = tl.load(tile_map_ptr + tl.num_programs(0) + tl.program_id(0))
        has_tile = mapped_row >= 0
        row = tl.maximum(mapped_row, 0).to(tl.int64)
    else:
        tile = tl.program_id(0)
        has_tile = tile >= 0
        row = first_row + tl.program_id(1).to(tl.int64)
    return row, tile, has_tile


@triton.jit
def _attend_keys(
    q,
    positions,
    sees_up_to,
    start,
    last_key,
    table_row,
    k_base,
    v_base,
    k_scale_base,
    v_scale_base,
    k_stride_slot,
    v_stride_slot,
    dims,
    dim_mask,
    num_kv_heads,
    sliding_window,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_LOOKAHEAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_QK: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
):
    """The online softmax of a tile of queries (at `positions`) over the key tiles from `start` to
    `last_key`, causal (or up to `sees_up_to`, HAS_LOOKAHEAD) and within the window:
    (denominator, unnormalised output)."""
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for tile_start in range(start, last_key + 1, BLOCK_N):
        keys_at = tile_start + tl.arange(0, BLOCK_N)
        in_range = keys_at <= last_key
        slots = _key_slots(table_row, keys_at, in_range, BLOCK_SIZE)
        load_mask = in_range[:, None] & dim_mask[None, :]
        k = tl.load(k_base + slots[:, None] * k_stride_slot + dims[None, :], mask=load_mask, other=0.0)
        v = tl.load(v_base + slots[:, None] * v_stride_slot + dims[None, :], mask=load_mask, other=0.0)
        k_scales, v_scales = _key_scales(k_scale_base, v_scale_base, slots, in_range, num_kv_heads, FP8)
        if HAS_LOOKAHEAD:
            visible = keys_at[None, :] <= sees_up_to[:, None]
        else:
            visible = keys_at[None, :] <= positions[:, None]
        # The window stays relative to the query's own position: an image is no longer than
        # the window (the caller's promise), so each of its tokens still sees its first.
        if HAS_WINDOW:
            visible &= keys_at[None, :] > positions[:, None] - sliding_window
        scores = _scores(q, k, DOT_PRECISION, NATIVE_QK, FP8, F16)
        if FP8:
            scores = scores * k_scales[None, :]
        scores = tl.where(visible, scores * scale, float("-inf"))
        tile_max = tl.maximum(running_max, tl.max(scores, 1))
        # With a window a query may see no key of a tile yet (max still -inf): subtract 0
        # instead, so exp gives 0 rather than NaN.
        safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        rescale = tl.exp(running_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        denominator = denominator * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + _weighted_values(probs, v, v_scales, DOT_PRECISION, FP8, F16)
        running_max = tile_max
    return denominator, acc


def extend_tile_size(head_dim: int) -> int:
    """Queries per program of the extend kernel: the tile of `extend_tiles` maps."""
    return _extend_config(head_dim)[0]


def _extend_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the extend kernel."""
    dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    return _EXTEND_CONFIG if dim_pad <= 128 else (32, 32, 8, 2)


def _launch_extend(
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
    extend_tiles,
    lookahead,
    scale,
    common,
    pdl,
) -> None:
    """The extend kernel over rows num_decode_rows.. (or the tiles `extend_tiles` maps); `common`:
    the arguments the decode and extend kernels share (launch._launch)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_extend_rows = seq_lens.shape[0] - num_decode_rows
    block_m, block_n, num_warps, num_stages = _extend_config(head_dim)
    if extend_tiles is None:
        grid = (triton.cdiv(max_query_len, block_m), num_extend_rows, num_q_heads)
    else:
        grid = (extend_tiles.shape[1], 1, num_q_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc.contiguous(),
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        first_row=num_decode_rows,
        # Any pointer when there is no map: the kernel does not read it then.
        tile_map_ptr=extend_tiles if extend_tiles is not None else seq_lens,
        lookahead_ptr=lookahead.contiguous() if lookahead is not None else seq_lens,
        scale=scale,
        GROUP=num_q_heads // common["num_kv_heads"],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # q.k in bf16/fp16 on CUDA: their products are exact in the fp32 accumulator, as in
        # tf32, at twice the tensor-core rate. Triton's interpreter gets bf16 dots wrong
        # (numpy has no bf16), so interpreted runs take the fp32 path.
        NATIVE_QK=q.is_cuda and q.dtype != torch.float32,
        USE_TILE_MAP=extend_tiles is not None,
        # A variant of its own: batches without images run the kernel as it was.
        HAS_LOOKAHEAD=lookahead is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(q, pdl),
        **common,
    )
