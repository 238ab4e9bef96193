"""The decode rows' attention (one query each, rows 0..num_decode_rows-1): flash-decoding.

The keys of a row are cut into `num_splits` equal splits (whole tiles of BLOCK_N keys) and one
program per (row, KV head, split) serves all query heads of the KV head's group together (padded
to 16 for tl.dot), so every key and value is read once. Each split writes its running max, sum
and unnormalised output in fp32; a small second kernel merges the splits of each (row, head).
The grid depends on host ints only (rows, KV heads, and `num_splits` from the batch size); a
split's length is computed on the device from the row's own length, so every row's keys are
spread over all splits however far below `max_seq_len` it is (a graph is captured at the longest
length, and splits cut from that would leave most programs idle and the rest looping over long
splits), and a CUDA graph replays for any lengths and block tables. Splits past a short row's
last tile write an empty partial at once, so the merge reads all splits in one load each,
without waiting for the row's length. With one split the first kernel writes the output itself.
Under PDL (infer.kernels.pdl) a split reads its row's length, block table and first tile of keys
and values before waiting for the kernel before, all but this step's key and value, which that
kernel stores and the split reads after the wait.
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import num_sms
from infer.kernels.paged_attention.tiles import _MIN_DOT, _key_scales, _key_tile, _scores, _weighted_values
from infer.kernels.pdl import await_inputs, launch_options

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
# An fp8 cache's decode takes 16 KiB of keys a loop step (128 of 128 dims) rather than bf16's 32
# keys, with its dots in fp16 (launch._FP8_F16_DOTS, whose comment has what measured them).
_FP8_DECODE_TILE_BYTES = 16384


@triton.jit
def _split_span(seq_len, first, num_splits, BLOCK_N: tl.constexpr):
    """(first key of split 0, keys per split) of a decode row: its visible keys (from the tile of
    `first` on) cut into num_splits whole tiles each, at least one."""
    span_start = (first // BLOCK_N) * BLOCK_N
    tiles = tl.cdiv(tl.maximum(seq_len - span_start, 1), BLOCK_N)
    return span_start, tl.cdiv(tiles, num_splits) * BLOCK_N


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
    running_max, denominator, acc = _attend_split(
        q_ptr, row, q_stride_token, q_heads, q_stride_head, head_mask, dims, dim_mask, start, end, first,
        seq_len, table_row, k_base, v_base, k_scale_base, v_scale_base, k_stride_slot, v_stride_slot,
        num_kv_heads, running_max, denominator, acc, scale, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, NATIVE_QK,
        FP8, F16, PDL,
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


@triton.jit
def _attend_split(
    q_ptr,
    row,
    q_stride_token,
    q_heads,
    q_stride_head,
    head_mask,
    dims,
    dim_mask,
    start,
    end,
    first,
    seq_len,
    table_row,
    k_base,
    v_base,
    k_scale_base,
    v_scale_base,
    k_stride_slot,
    v_stride_slot,
    num_kv_heads,
    running_max,
    denominator,
    acc,
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_QK: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
    PDL: tl.constexpr,
):
    """The online softmax of a split's keys `start..end` (those from `first` in view) for the
    query heads `q_heads` of row `row`: (running max, denominator, unnormalised output). Waits for the
    kernel before (`await_inputs`) after loading what it did not write (see the kernel)."""
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
    return running_max, denominator, acc


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


def _launch_decode(
    q, k_cache, v_cache, out, *, seq_lens, block_tables, num_decode_rows, max_seq_len, scale, common, pdl
) -> None:
    """The split kernel over rows 0..num_decode_rows-1, then the merge where there are splits;
    `common`: the arguments the decode and extend kernels share (launch._launch)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, dim_pad = common["num_kv_heads"], common["DIM_PAD"]
    group = num_q_heads // num_kv_heads
    block_n = _DECODE_BLOCK_N if dim_pad <= 64 else _DECODE_BLOCK_N // 2
    if common["FP8"]:
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
