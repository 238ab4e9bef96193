"""Weight-only 8-bit linear (w8a16): `y = x @ (weight * scale).T + bias` with int8 or fp8 weights.

`weight` is `[N, K]`, `torch.int8` or `torch.float8_e4m3fn`; `scale` is float32 with one entry per
`block_size = (bn, bk)` block of it, `[ceil(N / bn), ceil(K / bk)]`, so that the weight the model
means is `W[n, k] = weight[n, k] * scale[n // bn, k // bk]`. The layouts met in checkpoints:
`(1, K)`, one scale per output channel (int8, compressed-tensors), and `(128, 128)` blocks (fp8,
DeepSeek-V3 / Qwen3-FP8), which the loader may also cut to `(1, 128)` rows.

Decode reads every weight once per token, so its time is the weight's bytes over HBM bandwidth:
one byte per weight is half of bf16's two. Three paths, chosen by the number of rows M of x:

- M = 1: `_gemv_kernel`, fp32 FMAs. Programs tile (x row, BLOCK_N output rows, K split) and
  stream `[BLOCK_N, BLOCK_K]` weight tiles (16-byte loads per thread), convert them in registers
  (int8 through float bits, see `_weight_to_float32`), multiply by x and keep a 2D fp32
  accumulator that is reduced once after the K loop. A scale constant along K (`bk >= K`) is
  applied once at the end; a block scale shared by the tile's rows multiplies x's columns, a
  per-row one (`(1, 128)`) the weight tile.
- M > 1: `_dot_kernel`, tensor cores. The weight tile, converted to x's dtype, is the MMA's left
  operand and x the right one (`W @ x.T`: the small M is the MMA's N side, and the converted
  weight goes from registers into the MMA). A per-channel scale multiplies the fp32 accumulator
  after the K loop; a block scale multiplies the weight tile before its conversion to x's dtype
  (what dequantize-then-matmul does), so that the MMA accumulates in place and stays pipelined.
- M >= 512 (prefill chunks; CUDA, half-precision x): `_dequantize_kernel` writes the weight in
  x's dtype in one pass, and cuBLAS multiplies (faster there than the tensor-core kernel, whose
  converted weight tiles are re-read per tile of rows: see `_DEQUANTIZE_MIN_M`).

The M = 1 kernel also serves dense weights (bf16, fp16, fp32; `gemv`, no scale): the same
streaming loop, which at the 1-2B models' widths reads the weight faster than cuBLAS's GEMV does
and, being ours, takes part in programmatic dependent launch (`_dense_gemv_config` has its tiles).
Under PDL it loads its first weight tile before waiting for the kernel before (no kernel writes
a weight), so that the weight stream starts while that kernel ends. With a gated MLP's `[gate;
up]` weight it also applies the activation (`gated_gemv`): each program streams the up rows of
its gate rows and writes `act(gate) * up`, one kernel where the unfused pair takes two.

Where a scale varies along K, BLOCK_K divides bk, so that no tile straddles two blocks, except in
the M = 1 kernel when the tile's rows share their scales: there x's columns each take their own
block's scale, and a tile may span blocks (wider tiles stream faster). When the
output tiles alone would leave SMs idle, K is split across programs that write fp32 partial
sums; `_split_k_sum_kernel` adds them (and the bias) in a fixed order.

Accumulation is in fp32 throughout. The products are exact (an int8 or e4m3 value times x)
except in the tensor-core kernel with block scales and in the prefill path, where the scaled
weight is rounded to x's dtype first (a relative error of at most 2^-9 per weight in bf16,
2^-11 in fp16), as for
`F.linear(x, dequantize_weight(weight, scale, block_size, x.dtype))`. Triton's interpreter
computes bf16 dots wrongly (numpy has no bf16), so interpreted runs take fp32 dots, as do fp32
inputs (`input_precision="ieee"`).
"""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, num_sms, use_triton
from infer.kernels.activation import gated_activation, gelu_tanh_and_mul_ref, silu_and_mul_ref
from infer.kernels.pdl import await_inputs, launch_options

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)

# Rows of x up to which the FMA kernel runs: on an H100 the tensor-core kernel was as fast from
# M = 2 (the FMA kernel re-reads the weight tile for each row of x).
# docs/benchmarks/quantization.md#gpu-decisions-what-chose-them has these and the tiles' figures.
_GEMV_MAX_M = 1
# Rows of x from which dequantizing the weight in one pass and handing it to cuBLAS beats the
# tensor-core kernel (prefill chunks). On an H100, summed over Qwen3-8B's four projections: fp8
# 516 against 654 µs at 512 rows, int8 518 against 536; at 256 rows the tensor-core kernel wins.
_DEQUANTIZE_MIN_M = 512
# K is split while the output tiles alone number fewer than half the SMs, as long as each split
# keeps at least _MIN_SPLIT_K columns.
_MIN_SPLIT_K = 512
_MAX_SPLIT_K = 8
# tl.dot needs every dim to be at least 16.
_MIN_DOT = 16
# K-tile cap when the scale is constant along K.
_UNCAPPED = 1 << 30


@triton.jit
def _weight_values(w, WEIGHT_FP8: tl.constexpr):
    """The weight tile as loaded (fp8 weights travel as uint8: masked loads fill them with 0,
    which Triton's interpreter cannot cast to fp8) in its own dtype."""
    if WEIGHT_FP8:
        return w.to(tl.float8e4nv, bitcast=True)
    else:
        return w


@triton.jit
def _weight_to_float32(w, WEIGHT_FP8: tl.constexpr, FAST_INT8: tl.constexpr):
    if WEIGHT_FP8:
        return _weight_values(w, WEIGHT_FP8).to(tl.float32)
    elif FAST_INT8:
        # int8 -> fp32 through the bits of 2^23 + 128 + w (exact): integer adds and a float
        # subtract, instead of I2F, which runs at a quarter of the FMA rate on Hopper.
        bits = w.to(tl.int32) + 0x4B000080
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _gemv_tile(
    acc,
    w,
    x,
    k0,
    cols,
    col_mask,
    row_mask,
    scale_rows,
    tile_scale_row,
    scale_col_stride,
    scale_block_k,
    SCALE_PER_TILE: tl.constexpr,
    SCALE_ON_X: tl.constexpr,
    X_SCALE_PER_COLUMN: tl.constexpr,
    WEIGHT_FP8: tl.constexpr,
    FAST_INT8: tl.constexpr,
    FOLD: tl.constexpr,
):
    """`acc + w * x` for one `[BLOCK_N, BLOCK_K]` weight tile at column k0 (`cols`, `col_mask`:
    its columns), scaled per tile where the scale varies along K. FOLD > 1: each run of FOLD
    adjacent products of a row is summed first, so that `acc` holds `BLOCK_K / FOLD` columns. A
    thread's 16-byte load is 16 adjacent 8-bit weights, so FOLD = 16 sums inside each thread:
    fp8's 8 x 1024 tile with 4 warps then takes 64 registers instead of 126, and twice as many
    programs fit on an SM."""
    w = _weight_to_float32(w, WEIGHT_FP8, FAST_INT8)
    if SCALE_PER_TILE:
        if SCALE_ON_X and X_SCALE_PER_COLUMN:  # a tile across scale blocks: each column's own
            x *= tl.load(
                tile_scale_row + (cols // scale_block_k) * scale_col_stride, mask=col_mask, other=0.0
            )
        elif SCALE_ON_X:  # one multiply per column of x instead of one per weight
            x *= tl.load(tile_scale_row + (k0 // scale_block_k) * scale_col_stride)
        else:
            s = tl.load(scale_rows + (k0 // scale_block_k) * scale_col_stride, mask=row_mask, other=0.0)
            w = w * s[:, None]
    if FOLD > 1:
        products = tl.reshape(w * x[None, :], [w.shape[0], w.shape[1] // FOLD, FOLD])
        acc += tl.sum(products, axis=2)
    else:
        acc += w * x[None, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    x_row_stride,
    scale_row_stride,
    scale_col_stride,
    out_split_stride,
    out_row_stride,
    scale_block_n,
    scale_block_k,
    k_per_split,
    SCALED: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    SCALE_ON_X: tl.constexpr,
    X_SCALE_PER_COLUMN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_FP8: tl.constexpr,
    FAST_INT8: tl.constexpr,
    GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    FOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    """GATED (unsplit): the weight is `[2N, K]`, gate rows then up rows, and each program also
    streams the up rows of its gate rows (with their own scales), then writes `act(gate) * up`."""
    m = tl.program_id(0).to(tl.int64)
    first_row = tl.program_id(1) * BLOCK_N
    rows = first_row + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < N
    scale_rows = scale_ptr + (rows // scale_block_n).to(tl.int64) * scale_row_stride
    # The scale row shared by the whole tile, when BLOCK_N divides the scale block's rows.
    tile_scale_row = scale_ptr + (first_row // scale_block_n).to(tl.int64) * scale_row_stride
    k_start = split * k_per_split
    cols = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    x_ptrs = x_ptr + m * x_row_stride + cols
    acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N.to(tl.int64) * K
        up_scale_rows = scale_ptr + ((rows + N) // scale_block_n).to(tl.int64) * scale_row_stride
        up_tile_scale_row = scale_ptr + ((first_row + N) // scale_block_n).to(tl.int64) * scale_row_stride
        up_acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    k_stop = tl.minimum(k_start + k_per_split, K)
    # The first weight tile is loaded before waiting for the kernel before (await_inputs): no
    # kernel writes a weight, and under PDL its stream then starts while that kernel finishes.
    col_mask = cols < K
    w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
    if GATED:
        up = tl.load(up_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
    await_inputs(PDL)
    x = tl.load(x_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    acc = _gemv_tile(
        acc,
        w,
        x,
        k_start,
        cols,
        col_mask,
        row_mask,
        scale_rows,
        tile_scale_row,
        scale_col_stride,
        scale_block_k,
        SCALE_PER_TILE,
        SCALE_ON_X,
        X_SCALE_PER_COLUMN,
        WEIGHT_FP8,
        FAST_INT8,
        FOLD,
    )
    if GATED:
        up_acc = _gemv_tile(
            up_acc,
            up,
            x,
            k_start,
            cols,
            col_mask,
            row_mask,
            up_scale_rows,
            up_tile_scale_row,
            scale_col_stride,
            scale_block_k,
            SCALE_PER_TILE,
            SCALE_ON_X,
            X_SCALE_PER_COLUMN,
            WEIGHT_FP8,
            FAST_INT8,
            FOLD,
        )
        up_ptrs += BLOCK_K
    cols += BLOCK_K
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for k0 in tl.range(k_start + BLOCK_K, k_stop, BLOCK_K, loop_unroll_factor=UNROLL):
        col_mask = cols < K
        w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
        x = tl.load(x_ptrs, mask=col_mask, other=0.0).to(tl.float32)
        acc = _gemv_tile(
            acc,
            w,
            x,
            k0,
            cols,
            col_mask,
            row_mask,
            scale_rows,
            tile_scale_row,
            scale_col_stride,
            scale_block_k,
            SCALE_PER_TILE,
            SCALE_ON_X,
            X_SCALE_PER_COLUMN,
            WEIGHT_FP8,
            FAST_INT8,
            FOLD,
        )
        if GATED:
            up = tl.load(up_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
            up_acc = _gemv_tile(
                up_acc,
                up,
                x,
                k0,
                cols,
                col_mask,
                row_mask,
                up_scale_rows,
                up_tile_scale_row,
                scale_col_stride,
                scale_block_k,
                SCALE_PER_TILE,
                SCALE_ON_X,
                X_SCALE_PER_COLUMN,
                WEIGHT_FP8,
                FAST_INT8,
                FOLD,
            )
            up_ptrs += BLOCK_K
        cols += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if SCALED and not SCALE_PER_TILE:
        y *= tl.load(scale_rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        up_y = tl.sum(up_acc, axis=1)
        if SCALED and not SCALE_PER_TILE:
            up_y *= tl.load(up_scale_rows, mask=row_mask, other=0.0)
        if HAS_BIAS:
            up_y += tl.load(bias_ptr + N + rows, mask=row_mask, other=0.0).to(tl.float32)
        # Gate and up rounded to the output dtype first, as the unfused projection stores them.
        out_type = out_ptr.dtype.element_ty
        y = gated_activation(y.to(out_type).to(tl.float32), up_y.to(out_type).to(tl.float32), GELU_TANH)
    out_ptrs = out_ptr + split * out_split_stride + m * out_row_stride + rows
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _dot_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_row_stride,
    scale_row_stride,
    scale_col_stride,
    out_split_stride,
    out_row_stride,
    scale_block_n,
    scale_block_k,
    k_per_split,
    SCALE_PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_FP8: tl.constexpr,
    FAST_INT8: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    # Tiles in groups of GROUP_N weight-row tiles, x-row tiles fastest within a group: programs
    # that run together share weight tiles (and x tiles) in L2.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * num_m
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_m = (pid % per_group) // group_size

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: output columns
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # x rows
    row_mask = rows < N
    token_mask = tokens < M
    scale_rows = scale_ptr + (rows // scale_block_n).to(tl.int64) * scale_row_stride
    k_start = split * k_per_split
    cols = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * x_row_stride + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        col_mask = cols < K
        w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
        x = tl.load(x_ptrs, mask=token_mask[:, None] & col_mask[None, :], other=0.0)
        if SCALE_PER_TILE:
            # The block scale goes into the weight tile, so that the MMA accumulates in place.
            s = tl.load(scale_rows + (k0 // scale_block_k) * scale_col_stride, mask=row_mask, other=0.0)
            w = _weight_to_float32(w, WEIGHT_FP8, FAST_INT8) * s[:, None]
        else:
            w = _weight_values(w, WEIGHT_FP8)
        if NATIVE_DOT:
            acc = tl.dot(w.to(x_ptr.dtype.element_ty), tl.trans(x), acc)
        else:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        cols += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not SCALE_PER_TILE:
        acc *= tl.load(scale_rows, mask=row_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + split * out_split_stride + rows[:, None]
    out_ptrs += tokens.to(tl.int64)[None, :] * out_row_stride
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & token_mask[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    scale_row_stride,
    scale_col_stride,
    scale_block_n,
    scale_block_k,
    WEIGHT_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One pass: `out = weight * scale` in out's dtype (the prefill path's bf16 weight)."""
    await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    w = _weight_to_float32(tl.load(w_ptr + offsets, mask=mask, other=0), WEIGHT_FP8, True)
    scale_offsets = (rows // scale_block_n).to(tl.int64)[:, None] * scale_row_stride
    scale_offsets += (cols // scale_block_k)[None, :] * scale_col_stride
    s = tl.load(scale_ptr + scale_offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def _dequantized(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int], dtype, pdl: bool
) -> torch.Tensor:
    """`dequantize_weight` in one Triton pass (reads one byte, writes dtype's bytes per weight)."""
    N, K = weight.shape
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    weight_fp8 = weight.dtype == torch.float8_e4m3fn
    grid = (triton.cdiv(N, 32), triton.cdiv(K, 128))
    _dequantize_kernel[grid](
        weight.view(torch.uint8) if weight_fp8 else weight,
        scale,
        out,
        N,
        K,
        scale.stride(0),
        scale.stride(1),
        block_size[0],
        block_size[1],
        WEIGHT_FP8=weight_fp8,
        BLOCK_N=32,
        BLOCK_K=128,
        num_warps=4,
        **launch_options(weight, pdl),
    )
    return out


@triton.jit
def _split_k_sum_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    numel,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _k_tile_cap(K: int, block_k: int) -> int:
    """The largest K tile that never straddles two scale blocks (a power of two dividing bk)."""
    if block_k >= K:
        return _UNCAPPED
    return block_k & -block_k


def _split_k(tiles: int, K: int, block_k: int, num_sms: int, min_splits: int = 1) -> tuple[int, int]:
    """(splits, columns per split): at least `min_splits`, and more while the output tiles alone
    would leave most SMs idle, as long as each split keeps _MIN_SPLIT_K columns."""
    splits = min_splits
    while (
        splits < _MAX_SPLIT_K
        and tiles * splits < num_sms // 2
        and K // (2 * splits) >= max(_MIN_SPLIT_K, block_k)
    ):
        splits *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _gemv_config(M: int, N: int, K: int, k_cap: int, scale_rows: int) -> dict:
    """From sweeps on an H100 (Qwen3-8B and Llama-3.2-3B projections, M = 1, streamed from a CUDA
    graph over distinct weights). Per-channel scales: 16 rows x 512 columns with 8 warps for wide
    layers, 8 x 1024 with 4 warps for narrow and deep ones (more bytes in flight per program where
    there are fewer programs). Block scales of 8 rows or more (fp8's 128 x 128): 8 x 1024 with 4
    warps, the tile across 128-column blocks (x's columns take their own block's scale), which
    read Qwen3-8B's four fp8 projections in 88.5 µs against 109.6 for 128-column tiles; each
    thread folds its 16 adjacent products (FOLD), which took q|k|v from 13.6 to 11.9 µs and
    gate|up from 41.9 to 37.8 (o and down unchanged). Folding made int8's decode slower.
    Scales per 128 columns of each row: tiles of 16 x 128 with the loop unrolled 4 times and 8
    warps, except deep layers (K >= 8192, down_proj): 32 x 128 tiles with 4 warps and K split 8
    ways. docs/benchmarks/quantization.md#gpu-decisions-what-chose-them."""
    if k_cap < 512 and scale_rows % 8 == 0:
        block_k = min(1024, max(triton.next_power_of_2(K), 16))
        # Deep layers split K in two: fp8 down_proj 19.6 -> 17.9 µs on an H200 (quantization.md).
        min_splits = 2 if K >= 8192 else 1
        return dict(
            BLOCK_N=8, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1, FOLD=16, MIN_SPLITS=min_splits
        )
    if k_cap < 512:
        block_k = min(k_cap, max(triton.next_power_of_2(K), 16))
        if K >= 8192:
            return dict(BLOCK_N=32, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1, MIN_SPLITS=8)
        unroll = max(1, 512 // block_k)
        return dict(BLOCK_N=16, BLOCK_K=block_k, UNROLL=unroll, num_warps=8, num_stages=1)
    if N >= 5120 and K < 8192:
        block_n, block_k, num_warps = 16, 512, 8
    else:
        block_n, block_k, num_warps = 8, 1024, 4
    block_k = min(block_k, k_cap, max(triton.next_power_of_2(K), 16))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=1, num_warps=num_warps, num_stages=1)


def _dense_gemv_config(N: int, K: int) -> dict:
    """From sweeps of the bf16 projections of Llama-3.2-1B, Qwen3-1.7B and Gemma-3-1B (M = 1,
    streamed from a CUDA graph over distinct weights; docs/benchmarks/generation.md#one-row-gemv):
    - wide gate|up projections: 8 rows x 256 columns with 2 warps (H100; the best tile there
      varied from shape to shape within 3%);
    - K <= 2048 (q|k|v, o): 4 rows and all of K in one tile, 8 warps. The GEMV loads its first
      tile before its PDL wait, so the whole weight's load then overlaps the kernels before;
      gemma's q|k|v (K = 1152) took 1.95 µs under PDL on an H200 against 2.55 for two
      1024-column tiles;
    - deeper rows (down_proj): 4 x 1024 with 8 warps, unless that leaves fewer than 512 tiles
      (about 4 an SM): then 2 x 2048, the same bytes a tile over twice the programs (gemma's down,
      1152 rows: 5.95 µs against 6.65 on an H200; Qwen's and Llama's 2048 rows: 4 x 1024 was
      the fastest)."""
    if N >= 8192:
        block_n, block_k, num_warps = 8, 256, 2
    elif K <= 2048:
        block_n, block_k, num_warps = 4, 2048, 8
    elif triton.cdiv(N, 4) < 512:
        block_n, block_k, num_warps = 2, 2048, 8
    else:
        block_n, block_k, num_warps = 4, 1024, 8
    # A grid's second dimension holds at most 65535 programs (an LM head of 2^19 rows would
    # need more at 8 rows a tile).
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, 65535)))
    block_k = min(block_k, max(triton.next_power_of_2(K), 16))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=1, num_warps=num_warps, num_stages=1)


def _gated_gemv_config(N: int, K: int) -> dict:
    """The gated GEMV's tiles: `_dense_gemv_config` of the whole `[2N, K]` weight, as many gate
    rows a tile as the plain GEMV's rows (and as many up rows again). On an H100, halving the
    tile's rows instead, so that a program streams as many bytes as the plain GEMV's, was slower
    on all three 1-2B gate/up shapes (kernels-bench/bench_gated_gemv.py)."""
    return _dense_gemv_config(N, K)


def _dot_config(M: int, N: int, K: int, k_cap: int) -> dict:
    """Decode batches (M <= 64): thin tiles (32 weight rows) streamed 256 columns at a time, as
    a sweep on an H100 found for M = 2..16. Prefill: 128 x 128 tiles (x 256 tokens from M =
    1024), 64 columns deep, 128 with block scales below M = 1024 (5-12% faster there)."""
    if M <= 64:
        block_m = max(_MIN_DOT, triton.next_power_of_2(M))
        block_k = min(256, k_cap)
        return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=block_k, GROUP_N=8, num_warps=4, num_stages=4)
    block_m = 256 if M >= 1024 else 128
    block_k = min(128 if k_cap < _UNCAPPED and M < 1024 else 64, k_cap)
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block_k, GROUP_N=8, num_warps=8, num_stages=3)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block_size: tuple[int, int] | None,
    bias: torch.Tensor | None,
    *,
    kernel: str | None = None,
    config: dict | None = None,
    split_k: int | None = None,
    activation: str | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Run one kernel. `kernel` ("gemv", "dot" or "dequantize": the weight dequantized to x's dtype
    in one pass, then cuBLAS), `config` and `split_k` override the choice by shape (for tests and
    tuning). `scale` None: a dense weight in x's dtype, which only the GEMV kernel takes.
    `activation` ("silu" or "gelu_tanh"; one row): `gated_gemv` and `quantized_gated_gemv`,
    whose weight's first half of rows is the gate, and whose output is the gated activation, half
    as wide. `pdl`: launch with programmatic dependent launch (infer.kernels.pdl)."""
    N, K = weight.shape
    scaled = scale is not None
    if not scaled:
        block_size = (N, K)
        kernel = "gemv"
    bn, bk = block_size
    k_cap = _k_tile_cap(K, bk)
    gated = activation is not None
    if gated:
        kernel = "gemv"
        if config is None and not scaled:
            config = _gated_gemv_config(N, K)
        elif config is None:
            # The whole weight's tiles; 8-row tiles across scale blocks only where the up rows'
            # tiles line up with their scale blocks as the gate rows' do.
            config = _gemv_config(1, N, K, k_cap, bn if N // 2 % 8 == 0 else 1)
            if k_cap >= 512 and N // 2 % 8 == 0:
                # Per-channel scales: 8 x 512 tiles, 8 warps, 16 products folded a thread, which
                # took int8 gate|up with its activation from 37.9 to 32.6 µs on an H200 (quantization.md).
                config = dict(BLOCK_N=8, BLOCK_K=min(512, config["BLOCK_K"]), UNROLL=1, num_warps=8, FOLD=16)
        N //= 2
        split_k = 1  # the activation needs whole sums
    if x.stride(-1) != 1:
        x = x.contiguous()  # read only: a copy changes nothing the caller sees
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0 or K == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], N)
    if kernel is None:
        kernel = "gemv" if M <= _GEMV_MAX_M or k_cap < _MIN_DOT else "dot"
        if M >= _DEQUANTIZE_MIN_M and x.is_cuda and x.dtype != torch.float32:
            kernel = "dequantize"
    if kernel == "dequantize":
        return F.linear(x, _dequantized(weight, scale, block_size, x.dtype, pdl), bias)
    if config is None and not scaled:
        config = _dense_gemv_config(N, K)
    elif config is None:
        config = _gemv_config(M, N, K, k_cap, bn) if kernel == "gemv" else _dot_config(M, N, K, k_cap)
    config = dict(config)
    block_k = config["BLOCK_K"]
    scale_per_tile = bk < K
    # The GEMV multiplies x's columns by the scale when the tile's rows share a scale row (the up
    # rows' tile too, N rows further); then a tile may span scale blocks, each column taking its own.
    scale_on_x = (
        kernel == "gemv"
        and scale_per_tile
        and bn % config["BLOCK_N"] == 0
        and (not gated or N % config["BLOCK_N"] == 0)
    )
    if block_k > k_cap and not scale_on_x:
        raise ValueError(f"BLOCK_K {block_k} straddles scale blocks of {bk} columns")
    if block_k % config.get("FOLD", 1):
        raise ValueError(f"FOLD {config['FOLD']} does not divide BLOCK_K {block_k}")
    if kernel == "gemv":
        tiles = M * triton.cdiv(N, config["BLOCK_N"])
        # K per split: whole unrolled steps, so each split streams as many bytes per step.
        split_unit = block_k * config.get("UNROLL", 1)
        min_splits = config.pop("MIN_SPLITS", 1)
    else:
        tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
        split_unit = block_k
        # Decode batches: at most ~4096 columns per program (deep layers such as down_proj).
        min_splits = triton.cdiv(K, 4096) if M <= 64 else 1
    if split_k is None:
        splits, k_per_split = _split_k(tiles, K, split_unit, num_sms(x.device), min(min_splits, _MAX_SPLIT_K))
    else:
        k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
        splits = triton.cdiv(K, k_per_split)
    target = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    if gated and (M != 1 or splits > 1):
        raise ValueError("the gated GEMV takes one row of x and no K split")
    weight_fp8 = weight.dtype == torch.float8_e4m3fn
    fast_int8 = config.pop("FAST_INT8", True) and weight.dtype == torch.int8
    options = launch_options(x, pdl)
    common = dict(
        **options,
        SCALE_PER_TILE=scale_per_tile,
        HAS_BIAS=bias is not None and splits == 1,
        WEIGHT_FP8=weight_fp8,
        FAST_INT8=fast_int8,
    )
    if not scaled:
        scale = weight  # any pointer: an unscaled kernel does not read it
    args = (
        rows,
        weight.view(torch.uint8) if weight_fp8 else weight,
        scale,
        bias if bias is not None else scale,  # any pointer when there is no bias: not read
        target,
    )
    strides = (
        rows.stride(0),
        scale.stride(0) if scaled else 0,
        scale.stride(1) if scaled else 0,
        M * N if splits > 1 else 0,
        N,
        bn,
        bk,
        k_per_split,
    )
    if kernel == "gemv":
        config.setdefault("UNROLL", 1)
        config.setdefault("FOLD", 1)
        grid = (M, triton.cdiv(N, config["BLOCK_N"]), splits)
        _gemv_kernel[grid](
            *args,
            N,
            K,
            *strides,
            **common,
            SCALED=scaled,
            SCALE_ON_X=scale_on_x,
            X_SCALE_PER_COLUMN=block_k > k_cap,
            GATED=gated,
            GELU_TANH=activation == "gelu_tanh",
            **config,
        )
    else:
        native = x.is_cuda and x.dtype != torch.float32
        _dot_kernel[(tiles, splits)](*args, M, N, K, *strides, **common, NATIVE_DOT=native, **config)
    if splits > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
            target,
            bias if bias is not None else target,
            out,
            M * N,
            N,
            SPLIT_K=splits,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
            **options,
        )
    return out.view(*x.shape[:-1], N)


def _check_weight(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]) -> None:
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight must be torch.int8 or torch.float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2D [N, K], got shape {list(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {list(weight.stride())}")
    if (
        not isinstance(block_size, tuple | list)
        or len(block_size) != 2
        or not all(isinstance(b, int) and b > 0 for b in block_size)
    ):
        raise ValueError(f"block_size must be two positive ints (bn, bk), got {block_size!r}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    N, K = weight.shape
    bn, bk = block_size
    expected = (math.ceil(N / bn), math.ceil(K / bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale must have shape [ceil(N / bn), ceil(K / bk)] = {list(expected)} for weight "
            f"{list(weight.shape)} and block_size {tuple(block_size)}, got {list(scale.shape)}"
        )
    check_same_device(weight=weight, scale=scale)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None,
) -> None:
    check_dtype("x", x)
    _check_weight(weight, scale, block_size)
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must be weight's K = {weight.shape[1]}, got x of shape {list(x.shape)}"
        )
    if bias is not None:
        check_dtype("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [N] = [{weight.shape[0]}], got {list(bias.shape)}")
        check_same_device(x=x, weight=weight, bias=bias)
    else:
        check_same_device(x=x, weight=weight)


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`W[n, k] = float(weight[n, k]) * scale[n // bn, k // bk]`, rounded to `dtype` (plain torch)."""
    _check_weight(weight, scale, block_size)
    N, K = weight.shape
    bn, bk = block_size
    expanded = scale.repeat_interleave(bn, dim=0)[:N]
    if scale.shape[1] > 1:
        expanded = expanded.repeat_interleave(bk, dim=1)[:, :K]
    return (weight.float() * expanded).to(dtype)


def quantized_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: dequantize to fp32, matmul in fp32, add the bias, round to x's dtype."""
    _check(x, weight, scale, block_size, bias)
    y = F.linear(x.float(), dequantize_weight(weight, scale, block_size, torch.float32))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """`x @ dequantize_weight(weight, scale, block_size).T + bias`, accumulated in fp32, in x's dtype.

    x is `[..., K]` (bf16, fp16 or fp32); the leading dims are kept. `pdl`: launch with
    programmatic dependent launch (infer.kernels.pdl), as every op of this module takes it.
    """
    _check(x, weight, scale, block_size, bias)
    if use_triton(x):
        return _launch(x, weight, scale, tuple(block_size), bias, pdl=pdl)
    return quantized_linear_ref(x, weight, scale, block_size, bias)


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_dtype("x", x)
    if weight.dtype != x.dtype or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous 2D {x.dtype} tensor, got {weight.dtype} of shape "
            f"{list(weight.shape)} with strides {list(weight.stride())}"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1] or x.numel() != weight.shape[1]:
        raise ValueError(f"x must be one row of K = {weight.shape[1]}, got x of shape {list(x.shape)}")
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(
            f"bias must be a [{weight.shape[0]}] {x.dtype} tensor, got {bias.dtype} {list(bias.shape)}"
        )
    check_same_device(x=x, weight=weight, **({} if bias is None else {"bias": bias}))


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: matmul in fp32, add the bias, round to x's dtype."""
    _check_gemv(x, weight, bias)
    y = F.linear(x.float(), weight.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """`x @ weight.T + bias` for one row x (`[..., K]` holding K values) and a dense weight `[N, K]`
    of x's dtype, accumulated in fp32: the M = 1 kernel above, unscaled.

    For batch-1 decode on a GPU: at the 1-2B models' widths it streams the weight faster than
    cuBLAS's GEMV does, and under programmatic dependent launch (`infer.kernels.pdl`) it overlaps
    its neighbours as cuBLAS's kernels cannot (docs/benchmarks/generation.md#one-row-gemv).
    """
    _check_gemv(x, weight, bias)
    if use_triton(x):
        return _launch(x, weight, None, None, bias, pdl=pdl)
    return gemv_ref(x, weight, bias)


_ACTIVATIONS = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}


def _check_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
    _check_gemv(x, weight, bias)
    _check_gate_up(weight, activation)


def _check_gate_up(weight: torch.Tensor, activation: str) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if weight.shape[0] % 2:
        raise ValueError(f"weight must have an even number of rows (gate, then up), got {weight.shape[0]}")


def gated_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str
) -> torch.Tensor:
    """The reference: `gemv_ref`, then the gated activation (silu_and_mul or gelu_tanh_and_mul)."""
    _check_gated(x, weight, bias, activation)
    return _ACTIVATIONS[activation](gemv_ref(x, weight, bias))


def gated_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str,
    pdl: bool = False,
) -> torch.Tensor:
    """`act(gate) * up` of `gemv(x, weight, bias)` split into halves (gate, up), in one kernel:
    a gated MLP's gate/up projection and its activation (`activation` "silu" or "gelu_tanh") for
    one row x. The fused kernel reads the same weight bytes and saves the activation's kernel and
    the `[2N]` intermediate; gate and up are rounded to x's dtype before the activation, as the
    two ops store them, so the result is the unfused pair's.
    """
    _check_gated(x, weight, bias, activation)
    if use_triton(x) and weight.numel() > 0:
        return _launch(x, weight, None, None, bias, activation=activation, pdl=pdl)
    return gated_gemv_ref(x, weight, bias, activation=activation)


def _check_quantized_gated(x, weight, scale, block_size, bias, activation) -> None:
    _check(x, weight, scale, block_size, bias)
    if x.numel() != weight.shape[1]:
        raise ValueError(f"x must be one row of K = {weight.shape[1]}, got x of shape {list(x.shape)}")
    _check_gate_up(weight, activation)


def quantized_gated_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    activation: str,
) -> torch.Tensor:
    """The reference: `quantized_linear_ref`, then the gated activation."""
    _check_quantized_gated(x, weight, scale, block_size, bias, activation)
    return _ACTIVATIONS[activation](quantized_linear_ref(x, weight, scale, block_size, bias))


def quantized_gated_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    activation: str,
    pdl: bool = False,
) -> torch.Tensor:
    """`gated_gemv` for an 8-bit `[gate; up]` weight with its scales (as `quantized_linear` takes
    them): `act(gate) * up` of one row x in one kernel, gate and up rounded to x's dtype first, as
    `quantized_linear` and the activation op store them."""
    _check_quantized_gated(x, weight, scale, block_size, bias, activation)
    if use_triton(x) and weight.numel() > 0:
        return _launch(x, weight, scale, tuple(block_size), bias, activation=activation, pdl=pdl)
    return quantized_gated_gemv_ref(x, weight, scale, block_size, bias, activation=activation)
