"""The Triton kernels of `int4_linear` (its layout, launcher and references: infer.kernels.int4_linear).

A tile is `BLOCK_N` weight rows by `BLOCK_K` columns, `BLOCK_K // 2` bytes a row, and never
straddles two groups (BLOCK_K is a power of two dividing group_size), so one scale and one zero
point a row serve the whole tile and no column is ever masked (K is a multiple of group_size).
`_dequantized_tile` turns the bytes into the fp32 weights the model means, `(q - zero) * scale`,
exactly as the reference computes them: each nibble becomes a float through the bits of 2^23 + q
(integer ops and one float subtract, instead of I2F, which runs at a quarter of the FMA rate on
Hopper; as quantized_linear's int8), and `tl.interleave` puts the high nibbles' columns between
the low ones', so that the tile lines up with x's contiguous columns.

- `_int4_gemv_kernel` (M = 1): fp32 FMAs into a 2D accumulator reduced once after the K loop;
  under PDL the first tile's bytes and its scales and zeros are read before `await_inputs` (no
  kernel writes a weight); K may be split across programs (`_split_k_sum_kernel` adds the parts).
- `_int4_dot_kernel` (M > 1): the dequantized tile, rounded to x's dtype, is the MMA's left
  operand and x the right one (`W @ x.T`), fp32 accumulation, as quantized_linear's `_dot_kernel`.
- `_int4_dequantize_kernel`: the whole weight in x's dtype in one pass, for cuBLAS (prefill).
"""

import triton
import triton.language as tl

from infer.kernels.pdl import await_inputs

# 2^23 as a float: its bits OR-ed with q (0..15) are the float 2^23 + q.
_TWO_TO_23 = tl.constexpr(8388608.0)


@triton.jit
def _dequantized_tile(
    w,
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
    """`[BLOCK_N, BLOCK_K // 2]` bytes of group `group` -> `[BLOCK_N, BLOCK_K]` fp32 weights
    `(q - zero) * scale`, column 2j from byte j's low nibble and 2j + 1 from its high one."""
    rows = rows.to(tl.int64)
    scale = tl.load(scale_ptr + rows * scale_row_stride + group * scale_col_stride, mask=row_mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(zero_ptr + rows * zero_row_stride + group * zero_col_stride, mask=row_mask, other=0)
        offset = zero.to(tl.float32) + _TWO_TO_23
    else:
        offset = tl.full(rows.shape, _TWO_TO_23 + 8.0, tl.float32)  # SYMMETRIC_ZERO
    # 2^23 + q minus 2^23 + zero: exact, as is each operand.
    low = ((w & 0x0F).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - offset[:, None]
    high = ((w >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - offset[:, None]
    return tl.interleave(low, high) * scale.to(tl.float32)[:, None]


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
    group_size,
    bytes_per_split,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < N
    # The split's first byte and column. In bytes, so that Triton sees 16-byte alignment where the
    # launch argument has it (k_start // 2 would halve what it can prove): 16-byte loads.
    byte_start = split * bytes_per_split
    k_start = 2 * byte_start
    k_stop = tl.minimum(k_start + 2 * bytes_per_split, K)
    w_ptrs = (
        w_ptr + rows.to(tl.int64)[:, None] * w_row_stride + (byte_start + tl.arange(0, BLOCK_K // 2))[None, :]
    )
    x_ptrs = x_ptr + m * x_row_stride + k_start + tl.arange(0, BLOCK_K)
    strides = (scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride)
    # The first tile (bytes, scales, zeros) before waiting for the kernel before: no kernel
    # writes a weight, and under PDL the weight stream starts while that kernel ends.
    w = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
    tile = _dequantized_tile(
        w, scale_ptr, zero_ptr, rows, row_mask, k_start // group_size, *strides, HAS_ZEROS
    )
    await_inputs(PDL)
    acc = tile * tl.load(x_ptrs).to(tl.float32)[None, :]
    for k0 in tl.range(k_start + BLOCK_K, k_stop, BLOCK_K, loop_unroll_factor=UNROLL):
        w_ptrs += BLOCK_K // 2
        x_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
        tile = _dequantized_tile(
            w, scale_ptr, zero_ptr, rows, row_mask, k0 // group_size, *strides, HAS_ZEROS
        )
        acc += tile * tl.load(x_ptrs).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
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
    group_size,
    bytes_per_split,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
    byte_start = split * bytes_per_split  # in bytes, as in _int4_gemv_kernel
    k_start = 2 * byte_start
    w_ptrs = (
        w_ptr + rows.to(tl.int64)[:, None] * w_row_stride + (byte_start + tl.arange(0, BLOCK_K // 2))[None, :]
    )
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * x_row_stride + (k_start + tl.arange(0, BLOCK_K))[None, :]
    strides = (scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + 2 * bytes_per_split, K), BLOCK_K):
        w = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
        x = tl.load(x_ptrs, mask=token_mask[:, None], other=0.0)
        tile = _dequantized_tile(
            w, scale_ptr, zero_ptr, rows, row_mask, k0 // group_size, *strides, HAS_ZEROS
        )
        if NATIVE_DOT:
            acc = tl.dot(tile.to(x_ptr.dtype.element_ty), tl.trans(x), acc)
        else:
            acc = tl.dot(tile, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        w_ptrs += BLOCK_K // 2
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
    group_size,
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
    tile = _dequantized_tile(w, scale_ptr, zero_ptr, rows, row_mask, k0 // group_size, *strides, HAS_ZEROS)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :]
    tl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
