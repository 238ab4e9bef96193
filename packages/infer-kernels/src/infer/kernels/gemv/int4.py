"""The Triton kernels of `int4_linear` (its layout: gemv.int4_layout; its launcher: gemv.int4_linear).

A tensor-core or dequantizing tile is `BLOCK_N` weight rows by `BLOCK_K` columns inside one group
(BLOCK_K a power of two dividing group_size), so one scale and one zero point a row serve it; the
GEMV's tile may instead hold `GROUPS` whole groups of a power of two columns, `[BLOCK_N, GROUPS,
W]` words, each word scaled by its own group's scale. No column is ever masked (K is a multiple
of the tile). Each nibble q becomes a float through the bits of 128 + q (q in byte 2 under 128's
exponent byte: integer ops only, where I2F runs at a quarter of the FMA rate on Hopper), less 128
+ zero where the kernel needs `q - zero` itself (exact).

- `_int4_gemv_kernel` (M = 1) reads the weight as 32-bit words, 8 columns each (on CUDA unpacked
  by a few lines of PTX, `_UNPACK_PTX`), sums each word's 8 products in a chain of FMAs
  (`_word_products`: `(128 + q) * x` from `-(128 + zero)` times the word's sum of x, for
  half-precision x), and adds that times its group's scale into an fp32 accumulator of the
  tile's shape, reduced once after the K loop. Under PDL the first tile's words, scales and
  zeros are read before `await_inputs` (no kernel writes a weight); K may be split across
  programs (`_split_k_sum_kernel` adds the parts in a fixed order).
- `_int4_dot_kernel` (M > 1) reads the same words: `_word_columns`, the tile's `q - zero` in
  column order, in x's dtype (exact), is the MMA's left operand and x the right one (`W @ x.T`,
  as quantized_linear's `_dot_kernel`); each tile's fp32 sums are multiplied by its group's
  scale into the accumulator.
- `_int4_dequantize_kernel`: `_dequantized_tile`, `(q - zero) * scale` in fp32 (the reference's
  weight to the bit; `tl.interleave` puts the high nibbles' columns between the low ones'), for
  the whole weight in x's dtype in one pass, for cuBLAS (prefill).

The GEMV's cost, counted in the SASS for sm_90 (Triton 3.9, bf16 x, zero points) before its
chains started from the word's sum of x: a 64 x 128 tile's loop body was 285 instructions a
thread for its 64 weights, 4.5 a weight (362 without the PTX unpacking), a subtract a weight of
them now gone (not recounted). At the H200's published figures (4.8 TB/s of HBM, 9.6e12 weights a
second; 132 SMs issuing 4 x 32 lanes a clock at 1.98 GHz) a weight leaves about 3.5 instruction
issues, so its instructions rather than HBM may bound it; no tile of a sweep brought it within
2.3 times its ideal (docs/benchmarks/quantization.md#the-one-row-gemvs-tiles)."""

import triton
import triton.language as tl

from infer.kernels.activation import gated_activation
from infer.kernels.pdl import await_inputs

# 128 as a float: its bits (0x43000000) OR-ed with q << 16 (q in 0..15) are the float 128 + q, whose
# mantissa's last unit is 1: q sits in bits 16-19, one byte (byte 2) a PRMT can fill.
_BASE = tl.constexpr(128.0)
_BASE_BITS = tl.constexpr(0x43000000)


@triton.jit
def _group_scale_and_offset(
    scale_ptr,
    zero_ptr,
    rows,
    row_mask,
    group,
    scale_row_stride,
    scale_col_stride,
    zero_row_stride,
    zero_col_stride,
    HAS_ZEROS: tl.constexpr,
):
    """Group `group`'s scale of each row, and 128 + the row's zero point as a float (subtracted
    from `_word_bits`' float 128 + q, it leaves q - zero exactly)."""
    rows = rows.to(tl.int64)
    scale = tl.load(scale_ptr + rows * scale_row_stride + group * scale_col_stride, mask=row_mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(zero_ptr + rows * zero_row_stride + group * zero_col_stride, mask=row_mask, other=0)
        offset = zero.to(tl.float32) + _BASE
    else:
        offset = tl.full(rows.shape, _BASE + 8.0, tl.float32)  # SYMMETRIC_ZERO
    return scale.to(tl.float32), offset


@triton.jit
def _dequantized_tile(w, scale, offset):
    """`[BLOCK_N, BLOCK_K // 2]` bytes -> `[BLOCK_N, BLOCK_K]` fp32 weights `(q - zero) * scale`,
    column 2j from byte j's low nibble and 2j + 1 from its high one."""
    low = (((w & 0x0F).to(tl.int32) << 16) | _BASE_BITS).to(tl.float32, bitcast=True) - offset[:, None]
    high = (((w >> 4).to(tl.int32) << 16) | _BASE_BITS).to(tl.float32, bitcast=True) - offset[:, None]
    return tl.interleave(low, high) * scale[:, None]


@triton.jit
def _nibble(words, p: tl.constexpr):
    """The bits of 128 + q for nibble p of each 32-bit word (column 8j + p of word j)."""
    return (((words >> (4 * p)) & 0x0F) << 16) | _BASE_BITS


# Bytes of the packed word first spread to 0x0F0F0F0F (even columns) and 0xF0F0F0F0 >> 4 (odd),
# then one PRMT a column puts its byte into byte 2 under 128's exponent byte (0x43; selector
# 0x7k44: zero, zero, byte k of the spread word, 0x43 from the constant): 11 integer
# instructions a word, where Triton's shift-and-mask compiles to three or four a column.
_UNPACK_PTX = tl.constexpr(
    """{
.reg .b32 even, odd;
and.b32 even, $8, 0x0F0F0F0F;
shr.b32 odd, $8, 4;
and.b32 odd, odd, 0x0F0F0F0F;
prmt.b32 $0, even, 0x43000000, 0x7044;
prmt.b32 $1, odd, 0x43000000, 0x7044;
prmt.b32 $2, even, 0x43000000, 0x7144;
prmt.b32 $3, odd, 0x43000000, 0x7144;
prmt.b32 $4, even, 0x43000000, 0x7244;
prmt.b32 $5, odd, 0x43000000, 0x7244;
prmt.b32 $6, even, 0x43000000, 0x7344;
prmt.b32 $7, odd, 0x43000000, 0x7344;
}"""
)


@triton.jit
def _word_bits(words, PRMT: tl.constexpr):
    """The 8 columns of each word as the bits of 2^23 + q, int32 (PRMT: the PTX above, on CUDA)."""
    if PRMT:
        return tl.inline_asm_elementwise(
            _UNPACK_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.int32,) * 8, is_pure=True, pack=1
        )
    else:
        return (
            _nibble(words, 0),
            _nibble(words, 1),
            _nibble(words, 2),
            _nibble(words, 3),
            _nibble(words, 4),
            _nibble(words, 5),
            _nibble(words, 6),
            _nibble(words, 7),
        )


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
def _tile_sums(
    w_ptrs, x, x_sum, scale_ptr, zero_ptr, rows, row_mask, groups, strides, HAS_ZEROS, EXACT, PRMT
):
    """One weight tile's `[BLOCK_N, GROUPS, W]` sums, each word's times its group's scale."""
    w = _word_bits(tl.load(w_ptrs, mask=row_mask[:, None, None], other=0), PRMT)
    scale, offset = _tile_scales_and_offsets(scale_ptr, zero_ptr, rows, row_mask, groups, strides, HAS_ZEROS)
    return _word_products(w, offset, x, x_sum, EXACT) * scale[:, :, None]


@triton.jit
def _word_columns(bits, offset):
    """`_word_bits` of `[BLOCK_N, W]` words -> `[BLOCK_N, 8 * W]` floats q - zero (exact) in
    column order: joins nest as the reshape reads them, column 4a + 2b + c at [a, b, c]."""
    q0 = bits[0].to(tl.float32, bitcast=True) - offset[:, None]
    q1 = bits[1].to(tl.float32, bitcast=True) - offset[:, None]
    q2 = bits[2].to(tl.float32, bitcast=True) - offset[:, None]
    q3 = bits[3].to(tl.float32, bitcast=True) - offset[:, None]
    q4 = bits[4].to(tl.float32, bitcast=True) - offset[:, None]
    q5 = bits[5].to(tl.float32, bitcast=True) - offset[:, None]
    q6 = bits[6].to(tl.float32, bitcast=True) - offset[:, None]
    q7 = bits[7].to(tl.float32, bitcast=True) - offset[:, None]
    even = tl.join(tl.join(q0, q4), tl.join(q2, q6))
    odd = tl.join(tl.join(q1, q5), tl.join(q3, q7))
    return tl.reshape(tl.join(even, odd), [q0.shape[0], 8 * q0.shape[1]])


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
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
    PRMT: tl.constexpr,
    EXACT: tl.constexpr,
    GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
    PDL: tl.constexpr,
):
    """The weight read as 32-bit words (`w_ptr` int32, `w_row_stride` in words), 8 columns each,
    a tile `[BLOCK_N, GROUPS, W]`: GROUPS whole groups of W words (BLOCK_K > GROUP_SIZE), or
    part of one (GROUPS = 1); each word's 8 products summed, then scaled by their group's scale
    into the accumulator of the tile's shape: one multiply-add a word instead of a multiply a
    weight. GATED (one row, unsplit): the weight is `[2N, K]`, gate rows then up rows, each
    program streams the up rows of its gate rows too and writes `act(gate) * up`, as
    quantized_linear's GEMV."""
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
    w = _word_bits(tl.load(w_ptrs, mask=row_mask[:, None, None], other=0), PRMT)
    scale, offset = _tile_scales_and_offsets(*tile, groups, strides, HAS_ZEROS)
    if GATED:
        up = _word_bits(tl.load(up_ptrs, mask=row_mask[:, None, None], other=0), PRMT)
        up_scale, up_offset = _tile_scales_and_offsets(*up_tile, groups, strides, HAS_ZEROS)
    await_inputs(PDL)
    x, x_sum = _x_words(x_ptrs)
    acc = _word_products(w, offset, x, x_sum, EXACT) * scale[:, :, None]
    if GATED:
        up_acc = _word_products(up, up_offset, x, x_sum, EXACT) * up_scale[:, :, None]
    for k0 in tl.range(k_start + BLOCK_K, k_stop, BLOCK_K, loop_unroll_factor=UNROLL):
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
        x, x_sum = _x_words(x_ptrs)
        groups = k0 // GROUP_SIZE + tl.arange(0, GROUPS)
        acc += _tile_sums(w_ptrs, x, x_sum, *tile, groups, strides, HAS_ZEROS, EXACT, PRMT)
        if GATED:
            up_ptrs += BLOCK_K // 8
            up_acc += _tile_sums(up_ptrs, x, x_sum, *up_tile, groups, strides, HAS_ZEROS, EXACT, PRMT)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        up_y = tl.sum(tl.sum(up_acc, axis=2), axis=1)
        if HAS_BIAS:
            up_y += tl.load(bias_ptr + N + rows, mask=row_mask, other=0.0).to(tl.float32)
        # Gate and up rounded to the output dtype first, as the unfused projection stores them.
        out_type = out_ptr.dtype.element_ty
        y = gated_activation(y.to(out_type).to(tl.float32), up_y.to(out_type).to(tl.float32), GELU_TANH)
    out_ptrs = out_ptr + split * out_split_stride + m * out_row_stride + rows
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _int4_dot_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
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
    PRMT: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    # Tiles in groups of GROUP_N weight-row tiles, x-row tiles fastest within a group: programs
    # that run together share weight tiles (and x tiles) in L2 (as quantized_linear's _dot_kernel).
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * num_m
    first_n = (pid // per_group) * GROUP_N
    tiles_in_group = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % tiles_in_group
    pid_m = (pid % per_group) // tiles_in_group

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: output columns
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # x rows
    row_mask = rows < N
    token_mask = tokens < M
    # In words, as in _int4_gemv_kernel (16-byte loads).
    word_start = split * words_per_split
    k_start = 8 * word_start
    words = word_start + tl.arange(0, BLOCK_K // 8)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride + words[None, :]
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * x_row_stride + (k_start + tl.arange(0, BLOCK_K))[None, :]
    strides = (scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + 8 * words_per_split, K), BLOCK_K):
        w = _word_bits(tl.load(w_ptrs, mask=row_mask[:, None], other=0), PRMT)
        x = tl.load(x_ptrs, mask=token_mask[:, None], other=0.0)
        scale, offset = _group_scale_and_offset(
            scale_ptr, zero_ptr, rows, row_mask, k0 // GROUP_SIZE, *strides, HAS_ZEROS
        )
        # q - zero is exact in x's dtype, so the MMA's products are too; the scale multiplies the
        # tile's fp32 sums, one multiply-add an output instead of a multiply a weight.
        q = _word_columns(w, offset)
        if NATIVE_DOT:
            acc += tl.dot(q.to(x_ptr.dtype.element_ty), tl.trans(x)) * scale[:, None]
        else:
            acc += tl.dot(q, tl.trans(x.to(tl.float32)), input_precision="ieee") * scale[:, None]
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + split * out_split_stride + rows[:, None]
    out_ptrs += tokens.to(tl.int64)[None, :] * out_row_stride
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & token_mask[None, :])


@triton.jit
def _int4_dequantize_kernel(
    w_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    N,
    K,
    w_row_stride,
    scale_row_stride,
    scale_col_stride,
    zero_row_stride,
    zero_col_stride,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One pass: the `[N, K]` weight in out's dtype (the prefill path's weight for cuBLAS)."""
    await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    bytes_ = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride + bytes_[None, :]
    w = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
    strides = (scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride)
    scale, offset = _group_scale_and_offset(
        scale_ptr, zero_ptr, rows, row_mask, k0 // GROUP_SIZE, *strides, HAS_ZEROS
    )
    tile = _dequantized_tile(w, scale, offset)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :]
    tl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
