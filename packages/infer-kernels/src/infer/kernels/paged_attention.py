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

Two Triton kernels, one per kind of row:
- Decode rows (one query each, rows 0..num_decode_rows-1): flash-decoding. The keys of a row are
  cut into `num_splits` equal splits (whole tiles of BLOCK_N keys) and one program per (row, KV
  head, split) serves all query heads of the KV head's group together (padded to 16 for tl.dot),
  so every key and value is read once. Each split writes its running max, sum and unnormalised
  output in fp32; a small second kernel merges the splits of each (row, head). The grid depends
  on host ints only (rows, KV heads, and `num_splits` from the batch size); a split's length is
  computed on the device from the row's own length, so every row's keys are spread over all
  splits however far below `max_seq_len` it is (a graph is captured at the longest length, and
  splits cut from that would leave most programs idle and the rest looping over long splits),
  and a CUDA graph replays for any lengths and block tables. Splits past a short row's last tile
  write an empty partial at once, so the merge reads all splits in one load each, without
  waiting for the row's length. With one split the first kernel writes the output itself. Under
  PDL (infer.kernels.pdl) a split reads its row's length, block table and first tile of keys
  and values before waiting for the kernel before, all but this step's key and value, which
  that kernel stores and the split reads after the wait.
- Extend rows (prompt chunks): flash attention, one program per (tile of BLOCK_M queries of one
  row, query head), over key tiles up to the tile's last position, with causal and sliding-window
  masks and an online softmax. With `lookahead` (a variant of its own: batches without images
  run the kernel as before) the key tiles run up to the furthest key any query of the tile sees,
  as a tile may end inside an image whose last token lies in a later tile. Grid from host ints
  too: (tiles of max_query_len, extend rows, heads); tiles past a row's length exit. A CUDA
  graph that replays for any mix of prompt chunks passes `extend_tiles` instead, a device map of
  (row, tile) per program (`extend_tile_size` queries a tile) whose grid is the map's length:
  the graph fixes only how many tiles fit.

On a CPU the reference serves, but for decode rows: `paged_attention_cpu` gathers each decode
row's keys and runs them through torch's fused SDPA (one call instead of the reference's dozen
ops a row and layer, which dominate a CPU decode step's attention), and leaves extend rows to
the reference.

Scores, softmax and accumulators are fp32. Dots run in tf32 for bf16/fp16 inputs (tf32 holds
them exactly, on tensor cores) and in full fp32 for fp32 inputs; q.k of both kernels runs in the
inputs' own dtype on CUDA (the same exact products, twice as fast).
"""

import ctypes

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, num_sms, use_triton
from infer.kernels.cpu.native import POINTER, SIZE, native_function
from infer.kernels.kv_fp8 import dequantize_fp8_ref, fp8_scale, is_fp8
from infer.kernels.pdl import await_inputs, launch_options
from infer.kernels.store_kv import check_fp8_scales

# tl.dot needs every dim to be at least 16: the query heads of a group (1-8) are padded to it.
_MIN_DOT = 16
# Decode: about this many programs in all, and no more splits than a row of max_seq_len keys
# cut into splits of _MIN_SPLIT_KEYS. At batch 64 x 8 KV heads that is 8 splits (4096 programs
# over 132 SMs); at batch 1 and 4096 keys, 16. Fewer splits would leave SMs idle at small
# batches; more make the partial results (fp32, per query head) a larger share of the traffic.
_MIN_SPLIT_KEYS = 256
_TARGET_DECODE_PROGRAMS = 4096
# Keys per loop step of the decode kernel, halved for head_dim > 64 to bound registers: at 64
# keys of 128 dims (Qwen 3's heads) the split takes 228 registers a thread with 4 warps, at 32
# keys 158 (ptxas, sm_90, offline with the JIT's divisibility by 16), and 32 keys decoded
# qwen3-1.7b's shapes 3% faster on an H200 (docs/benchmarks/generation.md#decode-attention).
_DECODE_BLOCK_N = 64
_DECODE_WARPS = 4
# A decode grid of at most one program an SM (batch 1: 16 programs for Gemma 3's one KV head,
# 128 for Llama's and Qwen's eight) runs each program alone on its SM, where more warps shorten
# its latency: gemma-3-1b +1.7% and +1.6% on an H200, llama and qwen level
# (docs/benchmarks/generation.md#decode-attention). Larger grids keep 4 (not measured with 8).
_ONE_WAVE_DECODE_WARPS = 8
# 1 stage was within the run-to-run spread of 2 (same section).
_DECODE_STAGES = 2
# q.k of decode in bf16/fp16 as the extend kernel's (exact products in fp32, as tf32's): fewer
# instructions and registers; gemma-3-1b +0.9% and +0.7% on an H200, llama and qwen level.
# probs x v stays in tf32: bf16 would round the probabilities, and llama-3.2-1b decoded 4.6% slower
# with it (docs/benchmarks/generation.md#decode-attention).
_DECODE_NATIVE_QK = True
# An fp8 cache's decode is bound by the work a key takes, not by its bytes: its dots run in
# fp16 (k and v converted from e4m3 in one instruction a pair, q from bf16 exactly), and a loop
# step takes 16 KiB of keys (128 of 128 dims) rather than bf16's 32 keys. At llama-3.1-8b's heads,
# 64 rows, on an H200 that took fp8's decode attention from 1.32x to 1.12x bf16's time at 1,024
# keys a row and from 1.45x to 1.12x at 16,384 (docs/benchmarks/kv-cache.md#fp8-decode-attention);
# other head sizes take the same bytes a step, unmeasured.
_FP8_F16_DOTS = True
_FP8_DECODE_TILE_BYTES = 16384
# Extend (BLOCK_M queries, BLOCK_N keys, warps, stages) for head_dim <= 128, the fastest of a
# sweep on an H100 (Llama 3.2 1B heads, bf16): about 1.7x the time of torch's flash SDPA on
# contiguous K/V, against 3x for 64/64/4 warps.
_EXTEND_CONFIG = (128, 64, 8, 2)
# Integer arguments that change from step to step (batch shape, block-table width, decode rows)
# are marked do_not_specialize: Triton otherwise compiles a variant for each of their classes
# (== 1, divisible by 16, other) on first sight; under serving that lands mid-run, and every
# stream of that step waits for the compiler.


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _key_slots(block_table_row_ptr, keys_at, in_range, BLOCK_SIZE: tl.constexpr):
    """Flat cache slot of each key index (int64); keys out of range read block 0."""
    block_ids = tl.load(block_table_row_ptr + keys_at // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    return block_ids * BLOCK_SIZE + keys_at % BLOCK_SIZE


@triton.jit
def _split_span(seq_len, first, num_splits, BLOCK_N: tl.constexpr):
    """(first key of split 0, keys per split) of a decode row: its visible keys (from the tile of
    `first` on) cut into num_splits whole tiles each, at least one."""
    span_start = (first // BLOCK_N) * BLOCK_N
    tiles = tl.cdiv(tl.maximum(seq_len - span_start, 1), BLOCK_N)
    return span_start, tl.cdiv(tiles, num_splits) * BLOCK_N


@triton.jit
def _key_tile(
    tile_start, end, first, table_row, k_base, v_base, k_stride_slot, v_stride_slot, dims, BLOCK_N, BLOCK_SIZE
):
    """A tile of BLOCK_N keys from `tile_start`: their indices, which are in view (before `end`,
    from `first`), and the addresses of their keys and values."""
    keys_at = tile_start + tl.arange(0, BLOCK_N)
    in_range = keys_at < end
    visible = in_range & (keys_at >= first)
    slots = _key_slots(table_row, keys_at, in_range, BLOCK_SIZE)
    k_ptrs = k_base + slots[:, None] * k_stride_slot + dims[None, :]
    v_ptrs = v_base + slots[:, None] * v_stride_slot + dims[None, :]
    return keys_at, visible, slots, k_ptrs, v_ptrs


@triton.jit
def _key_scales(k_scale_base, v_scale_base, slots, visible, num_kv_heads, FP8: tl.constexpr):
    """With FP8: the float32 scales of a tile's keys and values (kv_fp8; `*_scale_base`: the
    scale bytes of the program's KV head, `num_kv_heads` apart from slot to slot). Without:
    1.0, and nothing is read."""
    if FP8:
        k_scales = fp8_scale(tl.load(k_scale_base + slots * num_kv_heads, mask=visible, other=0))
        v_scales = fp8_scale(tl.load(v_scale_base + slots * num_kv_heads, mask=visible, other=0))
    else:
        k_scales = 1.0
        v_scales = 1.0
    return k_scales, v_scales


@triton.jit
def _attend_tile(
    q,
    k,
    v,
    k_scales,
    v_scales,
    visible,
    running_max,
    denominator,
    acc,
    scale,
    DOT_PRECISION: tl.constexpr,
    NATIVE_QK: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
):
    """The online softmax's update by one tile of keys (`visible`: the tile's keys in view).
    NATIVE_QK: q and k as they are (bf16/fp16), as in the extend kernel. FP8: k and v are e4m3
    with a scale per key (`_key_scales`), applied to the scores and the values (`F16`: see
    `_scores` and `_weighted_values`)."""
    scores = _scores(q, k, DOT_PRECISION, NATIVE_QK, FP8, F16)
    if FP8:
        scores = scores * k_scales[None, :]
    scores = tl.where(visible[None, :], scores * scale, float("-inf"))
    tile_max = tl.maximum(running_max, tl.max(scores, 1))
    rescale = tl.exp(running_max - tile_max)
    probs = tl.exp(scores - tile_max[:, None])
    denominator = denominator * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + _weighted_values(probs, v, v_scales, DOT_PRECISION, FP8, F16)
    return tile_max, denominator, acc


@triton.jit
def _scores(q, k, DOT_PRECISION: tl.constexpr, NATIVE_QK: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr):
    """q . k of a tile, unscaled. An e4m3 k converts exactly to q's bf16/fp16 first, or with F16
    to fp16 (one instruction a pair), q with it (bf16 holds fewer bits than fp16)."""
    if NATIVE_QK:
        if FP8 and F16:
            scores = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
        else:
            if FP8:
                k = k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k))
    else:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
    return scores


@triton.jit
def _weighted_values(probs, v, v_scales, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr):
    """probs x v of a tile (fp32). FP8: v's scales applied, to the probabilities, or with F16 to
    v dequantized in fp16, then multiplied in fp16 (as many mantissa bits as tf32)."""
    if FP8 and F16:
        values = v.to(tl.float16) * v_scales[:, None].to(tl.float16)
        return tl.dot(probs.to(tl.float16), values)
    if FP8:
        probs = probs * v_scales[None, :]
    return tl.dot(probs, v.to(tl.float32), input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["block_table_stride", "num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
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
    num_splits,
    scale,
    sliding_window,
    num_kv_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_QK: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # Under PDL, all but q and the row's last key are read before waiting for the kernel before:
    # the row's length and block table are step inputs no kernel writes, and every key but the
    # last was written by an earlier step. The last (this token's) and q come from the kernel
    # just before (the rotation or store_kv), so they are read after the wait.
    seq_len = tl.load(seq_len_ptr + row).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - sliding_window, 0)
    span_start, split_size = _split_span(seq_len, first, num_splits, BLOCK_N)
    # Key tiles start at multiples of BLOCK_N (span_start and split_size are): every tile the
    # loop visits holds a visible key, so the running maximum is finite from the first tile on.
    start = span_start + split * split_size
    end = tl.minimum(start + split_size, seq_len)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    head_mask = heads < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denominator = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = block_table_ptr + row * block_table_stride
    k_base = k_ptr + kv_head * k_stride_head
    v_base = v_ptr + kv_head * v_stride_head
    k_scale_base = k_scale_ptr + kv_head
    v_scale_base = v_scale_ptr + kv_head
    # The split's first tile. An fp8 cache reads it after the wait, scales and all.
    keys_at, visible, slots, k_ptrs, v_ptrs = _key_tile(
        start, end, first, table_row, k_base, v_base, k_stride_slot, v_stride_slot, dims, BLOCK_N, BLOCK_SIZE
    )
    if PDL and not FP8:
        older = visible & (keys_at < seq_len - 1)
        k = tl.load(k_ptrs, mask=older[:, None] & dim_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=older[:, None] & dim_mask[None, :], other=0.0)
    await_inputs(PDL)
    if start < end:
        if PDL and not FP8:
            # This token's key and value, where the tile holds them: a load of one row.
            newest = (visible & (keys_at == seq_len - 1))[:, None] & dim_mask[None, :]
            k = tl.where(newest, tl.load(k_ptrs, mask=newest, other=0.0), k)
            v = tl.where(newest, tl.load(v_ptrs, mask=newest, other=0.0), v)
        else:
            k = tl.load(k_ptrs, mask=visible[:, None] & dim_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=visible[:, None] & dim_mask[None, :], other=0.0)
        k_scales, v_scales = _key_scales(k_scale_base, v_scale_base, slots, visible, num_kv_heads, FP8)
        q = tl.load(
            q_ptr + row * q_stride_token + q_heads[:, None] * q_stride_head + dims[None, :],
            mask=head_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if not NATIVE_QK:
            q = q.to(tl.float32)
        running_max, denominator, acc = _attend_tile(
            q, k, v, k_scales, v_scales, visible, running_max, denominator, acc, scale, DOT_PRECISION,
            NATIVE_QK, FP8, F16,
        )  # fmt: skip
        for tile_start in range(start + BLOCK_N, end, BLOCK_N):
            _, visible, slots, k_ptrs, v_ptrs = _key_tile(
                tile_start,
                end,
                first,
                table_row,
                k_base,
                v_base,
                k_stride_slot,
                v_stride_slot,
                dims,
                BLOCK_N,
                BLOCK_SIZE,
            )
            load_mask = visible[:, None] & dim_mask[None, :]
            k = tl.load(k_ptrs, mask=load_mask, other=0.0)
            v = tl.load(v_ptrs, mask=load_mask, other=0.0)
            k_scales, v_scales = _key_scales(k_scale_base, v_scale_base, slots, visible, num_kv_heads, FP8)
            running_max, denominator, acc = _attend_tile(
                q, k, v, k_scales, v_scales, visible, running_max, denominator, acc, scale, DOT_PRECISION,
                NATIVE_QK, FP8, F16,
            )  # fmt: skip

    store_mask = head_mask[:, None] & dim_mask[None, :]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + row * out_stride_token + q_heads[:, None] * out_stride_head + dims[None, :],
            (acc / denominator[:, None]).to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partials are [rows, q_heads, splits] (max, sum) and [rows, q_heads, splits, D] (acc).
        # A split past the row's last key writes the empty partial (max -inf, sum and acc 0),
        # which weighs nothing in the merge: the merge then reads every split without first
        # reading the row's length.
        part = (row * (tl.num_programs(1) * GROUP) + q_heads) * num_splits + split
        tl.store(part_max_ptr + part, running_max, mask=head_mask)
        tl.store(part_sum_ptr + part, denominator, mask=head_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_stride_token,
    out_stride_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    dim_mask = dims < HEAD_DIM
    split_mask = splits < num_splits
    part = (row * tl.num_programs(1) + head) * num_splits + splits
    # Every split in one load of each partial: no loop of dependent loads. Empty splits (and the
    # padding) have max -inf, so their weight is 0.
    split_max = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    split_acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    weight = tl.exp(split_max - tl.max(split_max, 0))
    denominator = tl.sum(split_sum * weight, 0)
    acc = tl.sum(split_acc * weight[:, None], 0)
    tl.store(
        out_ptr + row * out_stride_token + head * out_stride_head + dims,
        (acc / denominator).to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


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

        # Padded query rows (past the row's end) saw nothing: divide by 1, they are not stored.
        denominator = tl.where(query_mask, denominator, 1.0)
        tl.store(
            out_ptr + tokens[:, None] * out_stride_token + head * out_stride_head + dims[None, :],
            (acc / denominator[:, None]).to(out_ptr.dtype.element_ty),
            mask=query_mask[:, None] & dim_mask[None, :],
        )


def extend_tile_size(head_dim: int) -> int:
    """Queries per program of the extend kernel: the tile of `extend_tiles` maps."""
    return _extend_config(head_dim)[0]


def _extend_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the extend kernel."""
    dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    return _EXTEND_CONFIG if dim_pad <= 128 else (32, 32, 8, 2)


def decode_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per (row, KV head) of the decode kernel: host ints only, so a graph captured at
    one (batch, max_seq_len) replays with the same grid. The keys per split are the row's own."""
    wanted = triton.cdiv(_TARGET_DECODE_PROGRAMS, max(batch_size * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_seq_len, _MIN_SPLIT_KEYS)))


def decode_warm_up_lengths(num_kv_heads: int, max_seq_len: int) -> list[int]:
    """Context lengths whose one-row decode steps launch every variant of the split merge that
    any decode step may (its SPLITS_PAD, and num_splits a multiple of 16 or not, which Triton
    specializes on), longest last: a warm-up that runs them compiles each at start-up. More rows
    only lower decode_num_splits, to values one row reaches at a shorter length."""
    lengths, variants = [], set()
    for length in range(_MIN_SPLIT_KEYS + 1, max_seq_len + _MIN_SPLIT_KEYS, _MIN_SPLIT_KEYS):
        length = min(length, max_seq_len)
        num_splits = decode_num_splits(1, num_kv_heads, length)
        variant = (triton.next_power_of_2(num_splits), num_splits % 16 == 0)
        if num_splits > 1 and variant not in variants:
            variants.add(variant)
            lengths.append(length)
    return lengths


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
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
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
        block_n = _DECODE_BLOCK_N if dim_pad <= 64 else _DECODE_BLOCK_N // 2
        if fp8:
            block_n = max(32, min(128, _FP8_DECODE_TILE_BYTES // dim_pad))
        num_splits = decode_num_splits(num_decode_rows, num_kv_heads, max_seq_len)
        programs = num_decode_rows * num_kv_heads * num_splits
        one_wave = programs <= num_sms(q.device)
        parts = num_decode_rows * num_q_heads * num_splits if num_splits > 1 else 1
        part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(parts * head_dim, dtype=torch.float32, device=q.device)
        _decode_split_kernel[(num_decode_rows, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            out,
            part_max,
            part_sum,
            part_acc,
            seq_lens,
            block_tables,
            q.stride(0),
            q.stride(1),
            num_splits=num_splits,
            scale=scale,
            GROUP=group,
            GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
            BLOCK_N=block_n,
            SINGLE_SPLIT=num_splits == 1,
            NATIVE_QK=_DECODE_NATIVE_QK and q.is_cuda and q.dtype != torch.float32,
            num_warps=_ONE_WAVE_DECODE_WARPS if one_wave else _DECODE_WARPS,
            num_stages=_DECODE_STAGES,
            **common,
            **launch_options(q, pdl),
        )
        if num_splits > 1:
            splits_pad = triton.next_power_of_2(num_splits)
            _decode_merge_kernel[(num_decode_rows, num_q_heads)](
                out,
                part_max,
                part_sum,
                part_acc,
                out.stride(0),
                out.stride(1),
                num_splits,
                HEAD_DIM=head_dim,
                DIM_PAD=dim_pad,
                SPLITS_PAD=splits_pad,
                # A warp a 1,024 partial values (32 a thread), so that many splits do not spill.
                num_warps=min(8, max(1, splits_pad * dim_pad // 1024)),
                **launch_options(q, pdl),
            )
    num_extend_rows = seq_lens.shape[0] - num_decode_rows
    if num_extend_rows and num_tokens > num_decode_rows:
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
            GROUP=group,
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
