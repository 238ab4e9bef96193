"""Weight-only 4-bit linear (w4a16): `y = x @ W.T + bias` with W stored as packed 4-bit integers.

W is in `int4_layout`'s layout: `qweight` `[N, K // 2]` uint8 (two columns a byte), `scales`
and `zeros` (or None: symmetric) per group of `group_size` columns of a row.

Decode reads every weight once per token, so its time is the weight's bytes over HBM bandwidth:
half a byte per weight (plus a scale and a zero point per group) against bf16's two. The Triton
kernels (gemv.int4, gemv.int4_gemv) take the paths of quantized_linear's 8-bit ones, by the rows
M of x:

- M = 1, bf16 or fp16 x in groups of 128 on a GPU with bf16 `mma.sync`
  (`ONE_ROW_ON_TENSOR_CORES`): gemv.int4_mma, the words made the tensor cores' operands by a
  shift and a logic op a pair of weights (Gluon). Otherwise a GEMV streaming the packed rows as
  32-bit words (16-byte loads), unpacked in registers, fp32 FMAs, each group's scale applied to
  its partial sums, a 2D accumulator reduced once after the K loop; K split across programs
  while the programs would number fewer than two a SM, the last program of each tile adding the
  parts in a fixed order; under PDL the first tile is read before waiting for the kernel before.
- M > 1: tensor cores, the weight tile's `q - zero` in x's dtype (exact) as the MMA's left
  operand, the group's scale applied to the tile's fp32 sums.
- M >= 512 (prefill chunks; CUDA, half-precision x): the weight dequantized to x's dtype in one
  pass, then cuBLAS. Also any M for groups with no factor of 8 (no checkpoint's): the GEMV
  reads whole words of 8 columns.

A tile never straddles two groups (its K width is a power of two dividing group_size), so a row's
scale and zero point are constant over it. Accumulation is in fp32 throughout. The GEMV and the
tensor-core kernel multiply exact `q - zero` by x (exactly, for half-precision x), sum the
products and multiply the sums by the group's scale, where the reference multiplies each weight
by it: the two differ by a few fp32 roundings a term and the order of the sums, far below a
half-precision ulp. The prefill path rounds the weight `(q - zero) * scale` to x's dtype first
(a relative error of at most 2^-8 per weight in bf16, 2^-11 in fp16: the unit roundoff), as
`F.linear(x, dequantize_int4(..., x.dtype))` does. Interpreted runs (Triton's interpreter has
no bf16 dot) and fp32 x take fp32 dots.
"""

import functools
import importlib

import torch
import torch.nn.functional as F
import triton

from infer.kernels._dispatch import use_triton
from infer.kernels.gemv.configs import (
    _DEQUANTIZE_MIN_M,
    _GEMV_MAX_M,
    _MIN_DOT,
    _int4_dot_config,
    _int4_gemv_config,
    _int4_k_per_split,
)
from infer.kernels.gemv.int4 import _int4_dequantize_kernel, _int4_dot_kernel
from infer.kernels.gemv.int4_gemv import _int4_gemv_kernel
from infer.kernels.gemv.references import _check_int4, int4_linear_ref
from infer.kernels.gemv.streaming import _empty_product, _rows_and_output, _sum_splits, split_counts
from infer.kernels.pdl import launch_options

# The one-row GEMV's split-K parts summed by the last program of each tile, not by a kernel after
# it (`_sum_splits_in_the_last`; False: `_split_k_sum_kernel`): Qwen3-8B's four projections 3.8%
# faster with PDL on an H200 (docs/benchmarks/quantization.md#the-split-k-sum-inside-the-int4-gemv).
SUM_IN_THE_GEMV = True
# One row of bf16 or fp16 x in groups of 128 on tensor cores (gemv.int4_mma, Gluon), the gated
# gate|up too; False: the Triton GEMV (gemv.int4_gemv). Qwen3-8B int4 decodes W1 at 417.6 tok/s
# against 387.1 on an H200 (docs/benchmarks/quantization.md#the-one-row-gemv-on-tensor-cores-in-gluon).
ONE_ROW_ON_TENSOR_CORES = True
# Whether gemv.int4_mma takes PDL where its caller asks for it: W1 417.6 tok/s with, 413.5 without,
# one run each at 5036e16 (same section); alone, the four projections 47.1 µs with, 49.0 without.
MMA_UNDER_PDL = True
# Columns in one 32-bit word of the packed weight, the GEMV's unit. Groups with no factor of 8
# (none that checkpoints use) take the dequantize-then-matmul path.
_WORD = 8


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """`x @ W.T + bias` for `x` `[..., K]` and the packed 4-bit W described in the module; `pdl`
    launches a one-row product with programmatic dependent launch where the kernel runs."""
    _check_int4(x, qweight, scales, zeros, group_size, bias)
    if use_triton(x):
        return _launch(x, qweight, scales, zeros, group_size, bias, pdl=pdl)
    return int4_linear_ref(x, qweight, scales, zeros, group_size, bias)


@functools.cache
def _gluon_mma():
    """gemv.int4_mma, or None where this Triton has no Gluon (newer than the Triton the package
    asks for; imported only here)."""
    try:
        return importlib.import_module("infer.kernels.gemv.int4_mma")
    except ImportError:
        return None


def _mma_module(x: torch.Tensor, group_size: int, K: int):
    """gemv.int4_mma where its kernel takes this one-row product (`mma_gemv_applies`), else None."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    mma = _gluon_mma()
    return mma if mma is not None and mma.mma_gemv_applies(x, group_size, K) else None


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    *,
    kernel: str | None = None,
    config: dict | None = None,
    split_k: int | None = None,
    activation: str | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Run one kernel. `kernel` ("gemv", "dot", "dequantize": the weight dequantized to x's dtype
    in one pass, then cuBLAS, or "mma": gemv.int4_mma's one-row GEMV on tensor cores),
    `config` and `split_k` override the choice by shape (for tests and tuning). `activation`
    ("silu" or "gelu_tanh"; one row): `int4_gated_gemv` (gemv.gated)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    x, rows, out = _rows_and_output(x, N if activation is None else N // 2)
    M = rows.shape[0]
    if M == 0 or N == 0 or K == 0:
        return _empty_product(out, bias, x)
    if kernel is config is None and M == 1 and ONE_ROW_ON_TENSOR_CORES and _mma_module(rows, group_size, K):
        kernel = "mma"
    if kernel == "mma":
        mma = _mma_module(rows, group_size, K)
        if M != 1 or mma is None:
            raise ValueError("kernel 'mma' takes one bf16 or fp16 CUDA row of x, in groups of 128")
        if not qweight.is_contiguous() or qweight.data_ptr() % 16:
            qweight = qweight.clone(memory_format=torch.contiguous_format)  # 16-byte loads of whole rows
        pdl = pdl and MMA_UNDER_PDL
        out = mma.int4_mma_gemv(
            rows,
            qweight,
            scales,
            zeros,
            bias,
            out,
            config=config,
            split_k=split_k,
            activation=activation,
            pdl=pdl,
        )
        return out.view(*x.shape[:-1], out.shape[-1])
    if activation is not None:
        kernel, split_k, N = "gemv", 1, N // 2  # the activation needs whole sums of gate and up
    k_cap = group_size & -group_size  # the widest tile inside one group
    if kernel is None:
        kernel = "gemv" if M <= _GEMV_MAX_M or k_cap < _MIN_DOT else "dot"
        if k_cap < _WORD or (M >= _DEQUANTIZE_MIN_M and x.is_cuda and x.dtype != torch.float32):
            kernel = "dequantize"
    if kernel == "dequantize":
        weight = _dequantized(qweight, scales, zeros, group_size, x.dtype, pdl)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
    if config is None:
        if kernel == "gemv":
            config = _int4_gemv_config(N, K, k_cap, gated=activation is not None)
        else:
            config = _int4_dot_config(M, k_cap)
    config = dict(config)
    block_k = config["BLOCK_K"]
    # The GEMV's tile may hold whole groups (of a power of two columns: its words are a
    # `[groups, words a group]` block); any other tile stays inside one group.
    whole_groups = kernel == "gemv" and block_k > group_size and block_k % group_size == 0
    if group_size % block_k and not (whole_groups and group_size == k_cap):
        raise ValueError(f"BLOCK_K {block_k} straddles groups of {group_size} columns")
    if whole_groups and (K % block_k or block_k & (block_k - 1)):
        raise ValueError(f"BLOCK_K {block_k}: a GEMV tile of whole groups is a power of two dividing K = {K}")
    if block_k % _WORD or (kernel == "dot" and block_k < _MIN_DOT):
        raise ValueError(f"BLOCK_K {block_k}: the kernels read whole words of 8 columns, tl.dot 16 of them")
    if kernel == "gemv":
        config.setdefault("UNROLL", 1)
        config.setdefault("PREFETCH", 0)
        config.setdefault("GROUPS", max(1, block_k // group_size))
        tiles = M * triton.cdiv(N, config["BLOCK_N"])
    else:
        tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    k_per_split = _int4_k_per_split(kernel, config, tiles, M, K, split_k, x.device)
    splits = triton.cdiv(K, k_per_split)
    target = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    # The GEMV's last program of a tile sums its splits (no kernel after it), where it may.
    counts = split_counts(x.device, tiles) if kernel == "gemv" and splits > 1 and SUM_IN_THE_GEMV else None
    options = launch_options(x, pdl)
    if not qweight.is_contiguous() or qweight.data_ptr() % 4:
        qweight = qweight.clone(memory_format=torch.contiguous_format)  # whole, aligned words
    qweight = qweight.view(torch.int32)  # 8 columns a word (K is a multiple of BLOCK_K)
    args = (
        rows,
        qweight,
        scales,
        scales if zeros is None else zeros,
        scales if bias is None else bias,
        target,
    )
    sums = (out, target if counts is None else counts)  # the GEMV's sum_ptr and count_ptr
    strides = (
        rows.stride(0),
        qweight.stride(0),
        *scales.stride(),
        *((0, 0) if zeros is None else zeros.stride()),
        M * N if splits > 1 else 0,
        N,
        k_per_split // _WORD,  # words a split (k_per_split is a multiple of BLOCK_K)
    )
    # The group size is a compile-time constant (checkpoints use 32, 64 or 128): a tile's group
    # is then a shift of its column, not a division.
    common = dict(
        **options,
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None and (splits == 1 or counts is not None),
        **config,
    )
    common["PRMT"] = x.is_cuda and common.get("PRMT", True)
    if kernel == "gemv":
        _int4_gemv_kernel[(M, triton.cdiv(N, config["BLOCK_N"]), splits)](
            *args,
            *sums,
            N,
            K,
            *strides,
            **common,
            EXACT=x.dtype == torch.float32,
            GATED=activation is not None,
            GELU_TANH=activation == "gelu_tanh",
            SPLITS=0 if counts is None else splits,
        )
    else:
        native = x.is_cuda and x.dtype != torch.float32
        _int4_dot_kernel[(tiles, splits)](*args, M, N, K, *strides, **common, NATIVE_DOT=native)
    if splits > 1 and counts is None:
        _sum_splits(target, bias, out, options)
    return out.view(*x.shape[:-1], N)


def _dequantized(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, dtype, pdl: bool
) -> torch.Tensor:
    """`dequantize_int4` in one Triton pass (reads half a byte, writes dtype's bytes a weight)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    block_n, block_k = 32, min(group_size & -group_size, 128)
    _int4_dequantize_kernel[(triton.cdiv(N, block_n), K // block_k)](
        qweight,
        scales,
        scales if zeros is None else zeros,
        out,
        N,
        K,
        qweight.stride(0),
        *scales.stride(),
        *((0, 0) if zeros is None else zeros.stride()),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **launch_options(qweight, pdl),
    )
    return out
