"""The one-row GEMV of `int4_linear` (M = 1; the shared unpacking and the other kernels: gemv.int4).

The GEMV's tile holds `BLOCK_N` rows and either part of one group or `GROUPS` whole groups of a
power of two columns, `[BLOCK_N, GROUPS, W]` words, each word scaled by its own group's scale.
`_int4_gemv_kernel` reads the weight as 32-bit words, 8 columns each (`_word_bits`), sums each
word's 8 products in a chain of FMAs (`_word_products`: `(128 + q) * x` from `-(128 + zero)` times
the word's sum of x, for half-precision x), and adds that times its group's scale into an fp32
accumulator of the tile's shape, reduced once after the K loop. Under PDL the first tile's words,
scales and zeros are read before `await_inputs` (no kernel writes a weight); K may be split across
programs, the last of a tile's programs adding the parts in a fixed order
(`_sum_splits_in_the_last`; with `_split_k_sum_kernel` after it where the counts are off).

What a step loads ahead (PREFETCH, `_streamed_sums`): 0, nothing; 1, the next tile's words and
scales, so that they are in flight while this tile's unpacking and multiply-adds run (Nsight
found the GEMV's warps waiting on its loads, with too few warps resident to hide them:
docs/benchmarks/quantization.md#the-one-row-gemv-under-nsight-compute); 2, x's next columns too.
Which pays depends on the tile (configs._int4_gemv_config;
docs/benchmarks/quantization.md#a-tile-loaded-ahead).

The GEMV's cost, counted in the SASS for sm_90 (Triton 3.9, bf16 x, zero points) before its
chains started from the word's sum of x: a 64 x 128 tile's loop body was 285 instructions a
thread for its 64 weights, 4.5 a weight (362 without the PTX unpacking), a subtract a weight of
them now gone (not recounted). At the H200's published figures (4.8 TB/s of HBM, 9.6e12 weights a
second; 132 SMs issuing 4 x 32 lanes a clock at 1.98 GHz) a weight leaves about 3.5 instruction
issues, so its instructions rather than HBM may bound it; no tile of a sweep brought it within
2.3 times its ideal (docs/benchmarks/quantization.md#the-one-row-gemvs-tiles)."""

import triton
import triton.language as tl

from infer.kernels.gemv.int4 import _BASE, _word_bits
from infer.kernels.gemv.streaming import _sum_splits_in_the_last, gated_rows
from infer.kernels.pdl import await_inputs


@triton.jit
def _tile_scales_and_offsets(scale_ptr, zero_ptr, rows, row_mask, groups, strides, HAS_ZEROS: tl.constexpr):
    """`_group_scale_and_offset` of each of a tile's groups: `[BLOCK_N, GROUPS]` each."""
    rows = rows.to(tl.int64)[:, None]
    scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride = strides
    mask = row_mask[:, None]
    scale = tl.load(
        scale_ptr + rows * scale_row_stride + groups[None, :] * scale_col_stride, mask=mask, other=0.0
    )
    if HAS_ZEROS:
        zero_ptrs = zero_ptr + rows * zero_row_stride + groups[None, :] * zero_col_stride
        offset = tl.load(zero_ptrs, mask=mask, other=0).to(tl.float32) + _BASE
    else:
        offset = tl.full(scale.shape, _BASE + 8.0, tl.float32)  # SYMMETRIC_ZERO
    return scale.to(tl.float32), offset


@triton.jit
def _word_products(words, offset, x, x_sum, EXACT: tl.constexpr):
    """`[BLOCK_N, GROUPS, W]` words of the packed weight (`_word_bits` of them; W a group's words
    in the tile) -> the sum over each word's 8 columns of `(q - zero) * x`, a chain of
    multiply-adds; `x` is x's 8 columns of the words (`_x_words`), `x_sum` their sum a word,
    `offset` `[BLOCK_N, GROUPS]` (`_tile_scales_and_offsets`).

    Half-precision x: `(128 + q) * x` summed from `-(128 + zero) * x_sum`, one multiply-add a
    weight and one multiply a word, where subtracting the zero point from each weight first
    costs a subtract a weight. Each term is then about 25 times the size of `(q - zero) * x`, so
    the sum keeps about 19 of fp32's 24 bits: far below half precision's 8 or 11, but not fp32
    x's own; EXACT (fp32 x) subtracts first (`(128 + q) - (128 + zero)` is exact)."""
    offset = offset[:, :, None]
    if EXACT:
        t = tl.zeros(words[0].shape, tl.float32)
        for p in tl.static_range(8):
            t += (words[p].to(tl.float32, bitcast=True) - offset) * x[p][None, :, :]
    else:
        t = -offset * x_sum[None, :, :]
        for p in tl.static_range(8):
            t += words[p].to(tl.float32, bitcast=True) * x[p][None, :, :]
    return t


@triton.jit
def _x_words(x_ptrs):
    """x's `[GROUPS, W, 8]` columns of a tile's words in fp32: its 8 columns, each `[GROUPS, W]`
    (loaded as one 16-byte vector a word, then split), and their sum a word."""
    x = tl.load(x_ptrs).to(tl.float32)
    x = tl.reshape(x, [x.shape[0], x.shape[1], 2, 2, 2])  # [g, j, a, b, c] is column 4a + 2b + c
    c0, c1 = tl.split(x)
    b0c0, b1c0 = tl.split(c0)
    b0c1, b1c1 = tl.split(c1)
    x0, x4 = tl.split(b0c0)
    x2, x6 = tl.split(b1c0)
    x1, x5 = tl.split(b0c1)
    x3, x7 = tl.split(b1c1)
    x_sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    return (x0, x1, x2, x3, x4, x5, x6, x7), x_sum


@triton.jit
def _unpacked_sums(w, columns, x_sum, scale, offset, EXACT, PRMT):
    """One loaded weight tile's `[BLOCK_N, GROUPS, W]` sums, each word's times its group's scale:
    its words `w`, x's columns of them and their sums (`_x_words`), its scales and offsets."""
    return _word_products(_word_bits(w, PRMT), offset, columns, x_sum, EXACT) * scale[:, :, None]


@triton.jit
def _next_tile(w_ptrs, row_mask, tile, groups, strides, HAS_ZEROS):
    """The words, scales and offsets of the weight tile at `w_ptrs`, of groups `groups`."""
    w = tl.load(w_ptrs, mask=row_mask[:, None, None], other=0)
    scale, offset = _tile_scales_and_offsets(*tile, groups, strides, HAS_ZEROS)
    return w, scale, offset


@triton.jit
def _streamed_sums(
    first, up_first, w_ptrs, up_ptrs, x_ptrs, row_mask, tile, up_tile, k_start, k_stop, strides,
    GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    HAS_ZEROS: tl.constexpr, EXACT: tl.constexpr, PRMT: tl.constexpr, GATED: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    """The accumulators (the gate rows', or all rows', and the up rows') of a program's K split,
    from its first tile (`first`, `up_first`: `_next_tile` of it, loaded already). PREFETCH 0:
    each step loads a tile and sums it. 1: each step loads the next tile's words and scales, then
    sums the tile loaded a step before, so that the weight's loads stay in flight while the
    unpacking and multiply-adds run; x is loaded in the step that uses it. 2: x as well, carried
    to the next step as the fp32 columns the sums read (its raw tile, carried, would go into
    their layout through shared memory)."""
    w, scale, offset = first
    up, up_scale, up_offset = up_first
    if PREFETCH != 1:  # 1 loads each tile's x in the step that sums it
        columns, x_sum = _x_words(x_ptrs)
    if PREFETCH == 0:
        acc = _unpacked_sums(w, columns, x_sum, scale, offset, EXACT, PRMT)
        up_acc = acc
        if GATED:
            up_acc = _unpacked_sums(up, columns, x_sum, up_scale, up_offset, EXACT, PRMT)
    else:  # the first tile is summed in the first step
        acc = tl.zeros(w.shape, tl.float32)
        up_acc = tl.zeros(w.shape, tl.float32)
    for k0 in tl.range(k_start + BLOCK_K, k_stop, BLOCK_K, loop_unroll_factor=UNROLL):
        groups = k0 // GROUP_SIZE + tl.arange(0, GROUPS)
        next_w, next_scale, next_offset = _next_tile(
            w_ptrs + BLOCK_K // 8, row_mask, tile, groups, strides, HAS_ZEROS
        )
        if GATED:
            next_up, next_up_scale, next_up_offset = _next_tile(
                up_ptrs + BLOCK_K // 8, row_mask, up_tile, groups, strides, HAS_ZEROS
            )
        if PREFETCH == 2:
            next_columns, next_x_sum = _x_words(x_ptrs + BLOCK_K)
        elif PREFETCH == 1:
            columns, x_sum = _x_words(x_ptrs)
        else:  # no tile ahead: this step's is the next one
            w, scale, offset = next_w, next_scale, next_offset
            columns, x_sum = _x_words(x_ptrs + BLOCK_K)
            if GATED:
                up, up_scale, up_offset = next_up, next_up_scale, next_up_offset
        acc += _unpacked_sums(w, columns, x_sum, scale, offset, EXACT, PRMT)
        if GATED:
            up_acc += _unpacked_sums(up, columns, x_sum, up_scale, up_offset, EXACT, PRMT)
        if PREFETCH > 0:
            w, scale, offset = next_w, next_scale, next_offset
            if GATED:
                up, up_scale, up_offset = next_up, next_up_scale, next_up_offset
        if PREFETCH == 2:
            columns, x_sum = next_columns, next_x_sum
        w_ptrs += BLOCK_K // 8
        up_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    if PREFETCH > 0:  # the last tile, loaded in the last step
        if PREFETCH == 1:
            columns, x_sum = _x_words(x_ptrs)
        acc += _unpacked_sums(w, columns, x_sum, scale, offset, EXACT, PRMT)
        if GATED:
            up_acc += _unpacked_sums(up, columns, x_sum, up_scale, up_offset, EXACT, PRMT)
    return acc, up_acc


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    sum_ptr,
    count_ptr,
    N,
    K,
    x_row_stride,
    w_row_stride,
    scale_row_stride,
    scale_col_stride,
    zero_row_stride,
    zero_col_stride,
    out_split_stride,
    out_row_stride,
    words_per_split,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PRMT: tl.constexpr,
    EXACT: tl.constexpr,
    GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The weight read as 32-bit words (`w_ptr` int32, `w_row_stride` in words), 8 columns each,
    a tile `[BLOCK_N, GROUPS, W]`: GROUPS whole groups of W words (BLOCK_K > GROUP_SIZE), or
    part of one (GROUPS = 1); each word's 8 products summed, then scaled by their group's scale
    into the accumulator of the tile's shape: one multiply-add a word instead of a multiply a
    weight. GATED (one row, unsplit): the weight is `[2N, K]`, gate rows then up rows, each
    program streams the up rows of its gate rows too and writes `act(gate) * up`, as
    quantized_linear's GEMV. SPLITS (> 1): `out_ptr` takes this split's fp32 partial sums, and the
    last program of a tile adds the tile's parts and the bias into `sum_ptr`
    (`_sum_splits_in_the_last`, counting in `count_ptr`)."""
    m = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < N
    # The split's first word and column. In words, so that Triton sees 16-byte alignment where
    # the launch argument has it (k_start // 8 would lose what it can prove): 16-byte loads.
    word_start = split * words_per_split
    k_start = 8 * word_start
    k_stop = tl.minimum(k_start + 8 * words_per_split, K)
    W: tl.constexpr = BLOCK_K // 8 // GROUPS
    words = word_start + (tl.arange(0, GROUPS) * W)[:, None] + tl.arange(0, W)[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None, None] * w_row_stride + words[None, :, :]
    up_ptrs = w_ptrs + N.to(tl.int64) * w_row_stride  # GATED: the up rows, N past the gate rows
    x_ptrs = x_ptr + m * x_row_stride + (8 * words)[:, :, None] + tl.arange(0, 8)[None, None, :]
    strides = (scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride)
    tile = (scale_ptr, zero_ptr, rows, row_mask)
    up_tile = (scale_ptr, zero_ptr, rows + N, row_mask)
    # The first tile's words before waiting for the kernel before: no kernel writes a weight,
    # and under PDL the weight stream starts while that kernel ends.
    groups = k_start // GROUP_SIZE + tl.arange(0, GROUPS)
    first = _next_tile(w_ptrs, row_mask, tile, groups, strides, HAS_ZEROS)
    up_first = first  # the up rows' own where GATED (otherwise an unread name for the gate rows')
    if GATED:
        up_first = _next_tile(up_ptrs, row_mask, up_tile, groups, strides, HAS_ZEROS)
    await_inputs(PDL)
    acc, up_acc = _streamed_sums(
        first, up_first, w_ptrs, up_ptrs, x_ptrs, row_mask, tile, up_tile, k_start, k_stop, strides,
        GROUP_SIZE, GROUPS, BLOCK_K, UNROLL, HAS_ZEROS, EXACT, PRMT, GATED, PREFETCH,
    )  # fmt: skip
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS and SPLITS < 2:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        up_y = tl.sum(tl.sum(up_acc, axis=2), axis=1)
        y = gated_rows(y, up_y, bias_ptr, N, rows, row_mask, out_ptr.dtype.element_ty, HAS_BIAS, GELU_TANH)
    out_ptrs = out_ptr + split * out_split_stride + m * out_row_stride + rows
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask)
    if SPLITS > 1:
        _sum_splits_in_the_last(
            out_ptr, bias_ptr, sum_ptr, count_ptr, m, rows, row_mask, N, out_split_stride, SPLITS, HAS_BIAS
        )
