"""The one-row GEMV of dense and 8-bit weights (`_gemv_kernel`, `_dense_gemv_kernel`), fp32 FMAs,
and the fixed-order sum of K splits that every GEMV format's launcher shares.

Programs tile (x row, BLOCK_N output rows, K split) and stream `[BLOCK_N, BLOCK_K]` weight tiles
(16-byte loads per thread), convert them in registers (int8 through float bits, see
`_weight_to_float32`), multiply by x and keep a 2D fp32 accumulator that is reduced once after
the K loop. An 8-bit weight's scale constant along K (`bk >= K`) is applied once at the end; a
block scale shared by the tile's rows multiplies x's columns, a per-row one (`(1, 128)`) the
weight tile. A dense weight (bf16, fp16, fp32) takes the same loop unscaled. Under PDL the first
weight tile is loaded before waiting for the kernel before (no kernel writes a weight), so that
the weight stream starts while that kernel ends. GATED: the weight is a gated MLP's `[gate;
up]`, each program streams the up rows of its gate rows too and writes `act(gate) * up`.

When the output tiles alone would leave SMs idle, K is split across programs that write fp32
partial sums; `_split_k_sum_kernel` adds them (and the bias) in a fixed order (`_sum_splits`).
"""

import torch
import triton
import triton.language as tl

from infer.kernels.activation import gated_activation
from infer.kernels.pdl import await_inputs


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
    """The GEMV of an 8-bit weight (int8, or fp8 as uint8) with its scales (gemv.quantized; SCALED),
    and the body of `_dense_gemv_kernel`: a program's rows' sums over its K split (`_gemv_sums`),
    scaled, biased, gated and stored. GATED (unsplit): the weight is `[2N, K]`, gate rows then up
    rows, and each program also streams the up rows of its gate rows (with their own scales),
    then writes `act(gate) * up`."""
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
    # The up rows' own, where GATED (otherwise unread names for the gate rows').
    up_ptrs, up_scale_rows, up_tile_scale_row, up_acc = w_ptrs, scale_rows, tile_scale_row, acc
    if GATED:
        up_ptrs = w_ptrs + N.to(tl.int64) * K
        up_scale_rows = scale_ptr + ((rows + N) // scale_block_n).to(tl.int64) * scale_row_stride
        up_tile_scale_row = scale_ptr + ((first_row + N) // scale_block_n).to(tl.int64) * scale_row_stride
        up_acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc, up_acc = _gemv_sums(
        cols, w_ptrs, x_ptrs, acc, up_ptrs, up_acc, K, k_start, k_stop, row_mask, scale_rows,
        tile_scale_row, up_scale_rows, up_tile_scale_row, scale_col_stride, scale_block_k, SCALE_PER_TILE,
        SCALE_ON_X, X_SCALE_PER_COLUMN, WEIGHT_FP8, FAST_INT8, GATED, BLOCK_K, UNROLL, FOLD, PDL,
    )  # fmt: skip
    y = tl.sum(acc, axis=1)
    if SCALED and not SCALE_PER_TILE:
        y *= tl.load(scale_rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        up_y = tl.sum(up_acc, axis=1)
        if SCALED and not SCALE_PER_TILE:
            up_y *= tl.load(up_scale_rows, mask=row_mask, other=0.0)
        y = gated_rows(y, up_y, bias_ptr, N, rows, row_mask, out_ptr.dtype.element_ty, HAS_BIAS, GELU_TANH)
    out_ptrs = out_ptr + split * out_split_stride + m * out_row_stride + rows
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def gated_rows(
    gate, up, bias_ptr, N, rows, row_mask, out_type, HAS_BIAS: tl.constexpr, GELU_TANH: tl.constexpr
):
    """A gated GEMV's output rows from its fp32 gate and up sums (the gate's bias already added):
    up's bias (`bias_ptr` + N), both rounded to the output dtype first, as the unfused projection
    stores them, then `act(gate) * up`."""
    if HAS_BIAS:
        up += tl.load(bias_ptr + N + rows, mask=row_mask, other=0.0).to(tl.float32)
    return gated_activation(gate.to(out_type).to(tl.float32), up.to(out_type).to(tl.float32), GELU_TANH)


@triton.jit
def _gemv_sums(
    cols,
    w_ptrs,
    x_ptrs,
    acc,
    up_ptrs,
    up_acc,
    K,
    k_start,
    k_stop,
    row_mask,
    scale_rows,
    tile_scale_row,
    up_scale_rows,
    up_tile_scale_row,
    scale_col_stride,
    scale_block_k,
    SCALE_PER_TILE: tl.constexpr,
    SCALE_ON_X: tl.constexpr,
    X_SCALE_PER_COLUMN: tl.constexpr,
    WEIGHT_FP8: tl.constexpr,
    FAST_INT8: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    FOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    """`acc` and `up_acc`, the `[BLOCK_N, BLOCK_K // FOLD]` fp32 accumulators of the gate rows (all
    rows, unless GATED) and of the up rows, plus the products over columns k_start..k_stop of the
    tiles at `w_ptrs`, `up_ptrs` and x's at `x_ptrs` (`cols`: their columns)."""
    # The first weight tile is loaded before waiting for the kernel before (await_inputs): no
    # kernel writes a weight, and under PDL its stream then starts while that kernel finishes.
    col_mask = cols < K
    w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
    if GATED:
        up = tl.load(up_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
    await_inputs(PDL)
    x = tl.load(x_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    acc = _gemv_tile(
        acc, w, x, k_start, cols, col_mask, row_mask, scale_rows, tile_scale_row, scale_col_stride,
        scale_block_k, SCALE_PER_TILE, SCALE_ON_X, X_SCALE_PER_COLUMN, WEIGHT_FP8, FAST_INT8, FOLD,
    )  # fmt: skip
    if GATED:
        up_acc = _gemv_tile(
            up_acc, up, x, k_start, cols, col_mask, row_mask, up_scale_rows, up_tile_scale_row,
            scale_col_stride, scale_block_k, SCALE_PER_TILE, SCALE_ON_X, X_SCALE_PER_COLUMN, WEIGHT_FP8,
            FAST_INT8, FOLD,
        )  # fmt: skip
        up_ptrs += BLOCK_K
    cols += BLOCK_K
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for k0 in tl.range(k_start + BLOCK_K, k_stop, BLOCK_K, loop_unroll_factor=UNROLL):
        col_mask = cols < K
        w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
        x = tl.load(x_ptrs, mask=col_mask, other=0.0).to(tl.float32)
        acc = _gemv_tile(
            acc, w, x, k0, cols, col_mask, row_mask, scale_rows, tile_scale_row, scale_col_stride,
            scale_block_k, SCALE_PER_TILE, SCALE_ON_X, X_SCALE_PER_COLUMN, WEIGHT_FP8, FAST_INT8, FOLD,
        )  # fmt: skip
        if GATED:
            up = tl.load(up_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
            up_acc = _gemv_tile(
                up_acc, up, x, k0, cols, col_mask, row_mask, up_scale_rows, up_tile_scale_row,
                scale_col_stride, scale_block_k, SCALE_PER_TILE, SCALE_ON_X, X_SCALE_PER_COLUMN,
                WEIGHT_FP8, FAST_INT8, FOLD,
            )  # fmt: skip
            up_ptrs += BLOCK_K
        cols += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc, up_acc


@triton.jit
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    x_row_stride,
    out_split_stride,
    out_row_stride,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    FOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_gemv_kernel` for a dense weight in x's dtype (gemv.dense): no scales, each tile converted
    to fp32 as loaded. (`w_ptr` stands in for the scales' pointer, which no unscaled path reads.)"""
    _gemv_kernel(
        x_ptr, w_ptr, w_ptr, bias_ptr, out_ptr, N, K, x_row_stride, 0, 0, out_split_stride, out_row_stride,
        1, 1, k_per_split, False, False, False, False, HAS_BIAS, False, False, GATED, GELU_TANH, BLOCK_N,
        BLOCK_K, UNROLL, FOLD, PDL,
    )  # fmt: skip


@triton.jit
def _parts_in_split_order(part_ptrs, split_stride, mask, SPLITS: tl.constexpr, CACHE: tl.constexpr):
    """The sum of SPLITS fp32 parts, `split_stride` apart from `part_ptrs`, added in split order:
    the one order every split-K sum takes, so that where it is summed does not change the bits."""
    total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=CACHE)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(part_ptrs + split * split_stride, mask=mask, other=0.0, cache_modifier=CACHE)
    return total


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
    acc = _parts_in_split_order(partial_ptr + offs, numel, mask, SPLIT_K, "")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_in_the_last(
    partial_ptr, bias_ptr, out_ptr, count_ptr, m, rows, row_mask, N, split_stride, SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Once a program has stored its split of an output tile (`partial_ptr`, fp32 `[SPLITS, M,
    N]`): the program that stores the tile's last split adds its SPLITS parts in split order, then
    the bias, into `out_ptr` `[M, N]`, as `_split_k_sum_kernel` does, without a kernel of its own.
    Programs count their tile's stored splits in `count_ptr` (int32 a tile, zero before the
    launch); the last one sets the count back to zero for the next. The barrier, then one
    thread's acquire-release atomic at GPU scope, publish every thread's partial sums before the
    count (as a cooperative grid's barrier does); the last program reads the parts from L2."""
    tl.debug_barrier()
    count = count_ptr + m * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        total = _parts_in_split_order(partial_ptr + m * N + rows, split_stride, row_mask, SPLITS, ".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * N + rows, total.to(out_ptr.dtype.element_ty), mask=row_mask)
        tl.store(count, 0)


# Tiles a stream's split GEMVs may count at once (`split_counts`): 64K int32, 256 KB a stream.
_SPLIT_COUNTS = 65536
_split_counts_by_stream: dict[tuple, torch.Tensor] = {}


def split_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 counts of `_sum_splits_in_the_last` for the current stream of `device`, or
    None where `tiles` are more than they hold. One buffer a stream, kept for the process: kernels
    on one stream run in order (under PDL too: a kernel counts after its wait), and a CUDA graph
    that captured the buffer's address replays into it."""
    if tiles > _SPLIT_COUNTS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    if key not in _split_counts_by_stream:
        _split_counts_by_stream[key] = torch.zeros(_SPLIT_COUNTS, dtype=torch.int32, device=device)
    return _split_counts_by_stream[key]


def _rows_and_output(x: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x contiguous along K (a copy, where it is not, changes nothing the caller sees: x is only
    read), its rows `[M, K]`, and an uninitialised `[M, N]` output in x's dtype."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = x.reshape(-1, x.shape[-1])
    return x, rows, torch.empty((rows.shape[0], N), dtype=x.dtype, device=x.device)


def _empty_product(out: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A product with no rows, no output columns or K = 0: `bias` (or zeros) in `out`, shaped as x's rows."""
    out.zero_()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[1])


def _sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, options: dict) -> None:
    """`out` = the `[splits, M, N]` fp32 partial sums added in split order, plus the bias."""
    splits, M, N = partial.shape
    block = 1024
    _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
        partial,
        bias if bias is not None else partial,  # any pointer when there is no bias: not read
        out,
        M * N,
        N,
        SPLIT_K=splits,
        HAS_BIAS=bias is not None,
        BLOCK=block,
        num_warps=4,
        **options,
    )
