"""Weight-only 8-bit linear (w8a16): `y = x @ (weight * scale).T + bias` with int8 or fp8 weights.

`weight` is `[N, K]`, `torch.int8` or `torch.float8_e4m3fn`; `scale` is float32 with one entry per
`block_size = (bn, bk)` block of it, `[ceil(N / bn), ceil(K / bk)]`, so that the weight the model
means is `W[n, k] = weight[n, k] * scale[n // bn, k // bk]`. The layouts met in checkpoints:
`(1, K)`, one scale per output channel (int8, compressed-tensors), and `(128, 128)` blocks (fp8,
DeepSeek-V3 / Qwen3-FP8), which the loader may also cut to `(1, 128)` rows.

Decode reads every weight once per token, so its time is the weight's bytes over HBM bandwidth:
one byte per weight is half of bf16's two. Three paths, chosen by the number of rows M of x:

- M = 1: `_gemv_kernel` (gemv.streaming), fp32 FMAs over streamed weight tiles converted in
  registers (int8 through float bits, see `_weight_to_float32`), a 2D fp32 accumulator reduced
  once after the K loop. A scale constant along K (`bk >= K`) is applied once at the end; a
  block scale shared by the tile's rows multiplies x's columns, a per-row one (`(1, 128)`) the
  weight tile.
- M > 1: `_dot_kernel`, tensor cores. The weight tile, converted to x's dtype, is the MMA's left
  operand and x the right one (`W @ x.T`: the small M is the MMA's N side, and the converted
  weight goes from registers into the MMA). A per-channel scale multiplies the fp32 accumulator
  after the K loop; a block scale multiplies the weight tile before its conversion to x's dtype
  (what dequantize-then-matmul does), so that the MMA accumulates in place and stays pipelined.
- M >= 512 (prefill chunks; CUDA, half-precision x): `_dequantize_kernel` writes the weight in
  x's dtype in one pass, and cuBLAS multiplies (faster there than the tensor-core kernel, whose
  converted weight tiles are re-read per tile of rows: see `_DEQUANTIZE_MIN_M`).

The M = 1 kernel also serves dense weights (gemv.dense) and, with a gated MLP's `[gate; up]`
weight, the activation (gemv.gated).

Where a scale varies along K, BLOCK_K divides bk, so that no tile straddles two blocks, except in
the M = 1 kernel when the tile's rows share their scales: there x's columns each take their own
block's scale, and a tile may span blocks (wider tiles stream faster). When the
output tiles alone would leave SMs idle, K is split across programs that write fp32 partial
sums; `_split_k_sum_kernel` adds them (and the bias) in a fixed order (`configs._k_split` counts
the splits).

Accumulation is in fp32 throughout. The products are exact (an int8 or e4m3 value times x)
except in the tensor-core kernel with block scales and in the prefill path, where the scaled
weight is rounded to x's dtype first (a relative error of at most 2^-9 per weight in bf16,
2^-11 in fp16), as for
`F.linear(x, dequantize_weight(weight, scale, block_size, x.dtype))`. Triton's interpreter
computes bf16 dots wrongly (numpy has no bf16), so interpreted runs take fp32 dots, as do fp32
inputs (`input_precision="ieee"`).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from infer.kernels._dispatch import use_triton
from infer.kernels.gemv.configs import (
    _DEQUANTIZE_MIN_M,
    _GEMV_MAX_M,
    _MIN_DOT,
    _dot_config,
    _gemv_config,
    _k_split,
    _k_tile_cap,
)
from infer.kernels.gemv.references import _check_quantized, quantized_linear_ref
from infer.kernels.gemv.streaming import (
    _empty_product,
    _gemv_kernel,
    _rows_and_output,
    _sum_splits,
    _weight_to_float32,
    _weight_values,
)
from infer.kernels.pdl import await_inputs, launch_options


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """This program's (x-row tile, weight-row tile) of a tensor-core product: tiles in groups of
    GROUP_N weight-row tiles, x-row tiles fastest within a group, so that programs that run
    together share weight tiles (and x tiles) in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * num_m
    first_n = (pid // per_group) * GROUP_N
    tiles_in_group = tl.minimum(num_n - first_n, GROUP_N)
    return (pid % per_group) // tiles_in_group, first_n + (pid % per_group) % tiles_in_group


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
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_N)
    split = tl.program_id(1)

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


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
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
    tuning). `activation` ("silu" or "gelu_tanh"; one row): `quantized_gated_gemv`, whose
    weight's first half of rows is the gate, and whose output is the gated activation, half as
    wide. `pdl`: launch with programmatic dependent launch (infer.kernels.pdl)."""
    N, K = weight.shape
    bn, bk = block_size
    k_cap = _k_tile_cap(K, bk)
    gated = activation is not None
    if gated:
        kernel = "gemv"
        if config is None:
            # The whole weight's tiles; 8-row tiles across scale blocks only where the up rows'
            # tiles line up with their scale blocks as the gate rows' do.
            config = _gemv_config(1, N, K, k_cap, bn if N // 2 % 8 == 0 else 1)
            if k_cap >= 512 and N // 2 % 8 == 0:
                # Per-channel scales: 8 x 512 tiles, 8 warps, 16 products folded a thread, which
                # took int8 gate|up with its activation from 37.9 to 32.6 µs on an H200 (quantization.md).
                config = dict(BLOCK_N=8, BLOCK_K=min(512, config["BLOCK_K"]), UNROLL=1, num_warps=8, FOLD=16)
        N //= 2
        split_k = 1  # the activation needs whole sums
    x, rows, out = _rows_and_output(x, N)
    M = rows.shape[0]
    if M == 0 or N == 0 or K == 0:
        return _empty_product(out, bias, x)
    if kernel is None:
        kernel = "gemv" if M <= _GEMV_MAX_M or k_cap < _MIN_DOT else "dot"
        if M >= _DEQUANTIZE_MIN_M and x.is_cuda and x.dtype != torch.float32:
            kernel = "dequantize"
    if kernel == "dequantize":
        return F.linear(x, _dequantized(weight, scale, block_size, x.dtype, pdl), bias)
    if config is None:
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
    else:
        tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    splits, k_per_split = _k_split(kernel, config, tiles, M, K, split_k, x.device)
    target = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    if gated and (M != 1 or splits > 1):
        raise ValueError("the gated GEMV takes one row of x and no K split")
    weight_fp8 = weight.dtype == torch.float8_e4m3fn
    options = launch_options(x, pdl)
    common = dict(
        **options,
        SCALE_PER_TILE=scale_per_tile,
        HAS_BIAS=bias is not None and splits == 1,
        WEIGHT_FP8=weight_fp8,
        FAST_INT8=config.pop("FAST_INT8", True) and weight.dtype == torch.int8,
    )
    args = (
        rows,
        weight.view(torch.uint8) if weight_fp8 else weight,
        scale,
        bias if bias is not None else scale,  # any pointer when there is no bias: not read
        target,
    )
    split_stride = M * N if splits > 1 else 0
    strides = (rows.stride(0), scale.stride(0), scale.stride(1), split_stride, N, bn, bk, k_per_split)
    if kernel == "gemv":
        config.setdefault("UNROLL", 1)
        config.setdefault("FOLD", 1)
        _gemv_kernel[(M, triton.cdiv(N, config["BLOCK_N"]), splits)](
            *args,
            N,
            K,
            *strides,
            **common,
            SCALED=True,
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
        _sum_splits(target, bias, out, options)
    return out.view(*x.shape[:-1], N)


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
    _check_quantized(x, weight, scale, block_size, bias)
    if use_triton(x):
        return _launch(x, weight, scale, tuple(block_size), bias, pdl=pdl)
    return quantized_linear_ref(x, weight, scale, block_size, bias)
