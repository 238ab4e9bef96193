"""The Triton kernels of `int4_linear` for more than one row, and what every int4 kernel shares (the
layout: gemv.int4_layout; the launcher: gemv.int4_linear; the one-row GEMV: gemv.int4_gemv).

A tensor-core or dequantizing tile is `BLOCK_N` weight rows by `BLOCK_K` columns inside one group
(BLOCK_K a power of two dividing group_size), so one scale and one zero point a row serve it. No
column is ever masked (K is a multiple of the tile). Each nibble q becomes a float through the bits
of 128 + q (q in byte 2 under 128's exponent byte: integer ops only, where I2F runs at a quarter of
the FMA rate on Hopper; `_word_bits`, on CUDA a few lines of PTX, `_UNPACK_PTX`), less 128 + zero
where the kernel needs `q - zero` itself (exact).

- `_int4_dot_kernel` (M > 1) reads the weight as 32-bit words, 8 columns each: `_word_columns`, the
  tile's `q - zero` in column order, in x's dtype (exact), is the MMA's left operand and x the
  right one (`W @ x.T`, as quantized_linear's `_dot_kernel`); each tile's fp32 sums are
  multiplied by its group's scale into the accumulator.
- `_int4_dequantize_kernel`: `_dequantized_tile`, `(q - zero) * scale` in fp32 (the reference's
  weight to the bit; `tl.interleave` puts the high nibbles' columns between the low ones'), for
  the whole weight in x's dtype in one pass, for cuBLAS (prefill)."""

import triton
import triton.language as tl

from infer.kernels.gemv.quantized import grouped_tile
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
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_N)
    split = tl.program_id(1)

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
