"""Weight-only 4-bit linear (w4a16): `y = x @ W.T + bias` with W stored as packed 4-bit integers.

One layout for every source of 4-bit weights (GPTQ and AWQ checkpoints, which the loader repacks,
and round-to-nearest quantization at load), chosen so that a row of W is contiguous along K, as
the 8-bit GEMV streams it (quantized_linear):

- `qweight` `[N, K // 2]` uint8: byte j of row n holds W's column 2j in its low nibble and
  column 2j + 1 in its high nibble, each an unsigned integer q in 0..15;
- `scales` `[N, K // group_size]` (float32, float16 or bfloat16): one scale per group of
  `group_size` consecutive columns of a row;
- `zeros` `[N, K // group_size]` uint8 in 0..15, one zero point per group, or None for symmetric
  weights, whose zero point is 8.

The weight the model means is `W[n, k] = (q[n, k] - zero[n, k // group_size]) * scale[n, k //
group_size]`. A GPTQ checkpoint with act-order (`desc_act`, a `g_idx` that is not sorted) has
its columns permuted by the loader so that groups are contiguous; the caller gathers x's columns
by the same permutation.

Decode reads every weight once per token, so its time is the weight's bytes over HBM bandwidth:
half a byte per weight (plus a scale and a zero point per group) against bf16's two. The Triton
kernels (infer.kernels.int4_kernels) take the paths of quantized_linear's 8-bit ones, by the rows
M of x:

- M = 1: a GEMV streaming the packed rows as 32-bit words (16-byte loads), unpacked in
  registers, fp32 FMAs, each group's scale applied to its partial sums, a 2D accumulator reduced
  once after the K loop; K split across programs (a fixed-order sum after) while the programs
  would number fewer than two a SM; under PDL the first tile is read before waiting for the
  kernel before.
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

import torch
import torch.nn.functional as F
import triton

from infer.kernels._dispatch import check_dtype, check_same_device, num_sms, use_triton
from infer.kernels.int4_kernels import _int4_dequantize_kernel, _int4_dot_kernel, _int4_gemv_kernel
from infer.kernels.pdl import launch_options
from infer.kernels.quantized_linear import (
    _ACTIVATIONS,
    _MAX_SPLIT_K,
    _check_gate_up,
    _split_k,
    _split_k_sum_kernel,
)

# The zero point of symmetric weights (GPTQ's sym=True): q in 0..15 means q - 8 in -8..7.
SYMMETRIC_ZERO = 8

# Rows of x up to which the FMA kernel runs (as quantized_linear's: the FMA kernel re-reads the
# weight tile for each row of x, the tensor-core one from M = 2 does not).
_GEMV_MAX_M = 1
# Rows of x from which the weight is dequantized to x's dtype in one pass and cuBLAS multiplies:
# the 8-bit path's threshold (quantized_linear._DEQUANTIZE_MIN_M, measured for int8 and fp8 on an
# H100), taken over until the 4-bit one is measured.
_DEQUANTIZE_MIN_M = 512
# tl.dot needs every dim to be at least 16.
_MIN_DOT = 16
# Columns in one 32-bit word of the packed weight, the GEMV's unit. Groups with no factor of 8
# (none that checkpoints use) take the dequantize-then-matmul path.
_WORD = 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`[N, K]` integers in 0..15 (any integer dtype) -> `[N, K // 2]` uint8, column 2j in byte
    j's low nibble and 2j + 1 in its high nibble."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be [N, K] with K even, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: `[N, K // 2]` uint8 -> `[N, K]` uint8 in 0..15."""
    low = qweight & 0x0F
    high = qweight >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The `[N, K]` weight the packed one means, computed in fp32 and rounded once to `dtype`."""
    _check_weight(qweight, scales, zeros, group_size)
    q = unpack_int4(qweight).float()
    zero = SYMMETRIC_ZERO if zeros is None else zeros.float().repeat_interleave(group_size, dim=1)
    return ((q - zero) * scales.float().repeat_interleave(group_size, dim=1)).to(dtype)


def int4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int4_linear` in PyTorch: the dequantized weight in fp32, an fp32 product, one rounding to
    x's dtype."""
    _check(x, qweight, scales, zeros, group_size, bias)
    weight = dequantize_int4(qweight, scales, zeros, group_size)
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(x.dtype)


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
    _check(x, qweight, scales, zeros, group_size, bias)
    if use_triton(x):
        return _launch(x, qweight, scales, zeros, group_size, bias, pdl=pdl)
    return int4_linear_ref(x, qweight, scales, zeros, group_size, bias)


def int4_gated_gemv_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    activation: str,
) -> torch.Tensor:
    """The reference: `int4_linear_ref`, then the gated activation."""
    _check_gated(x, qweight, scales, zeros, group_size, bias, activation)
    return _ACTIVATIONS[activation](int4_linear_ref(x, qweight, scales, zeros, group_size, bias))


def int4_gated_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    activation: str,
    pdl: bool = False,
) -> torch.Tensor:
    """`quantized_gated_gemv` for a 4-bit `[gate; up]` weight (2N rows, in the layout above):
    `act(gate) * up` of one row x in one kernel, gate and up rounded to x's dtype first, as
    `int4_linear` and the activation op store them."""
    _check_gated(x, qweight, scales, zeros, group_size, bias, activation)
    if use_triton(x) and qweight.numel() > 0 and group_size & -group_size >= _WORD:
        return _launch(x, qweight, scales, zeros, group_size, bias, activation=activation, pdl=pdl)
    return int4_gated_gemv_ref(x, qweight, scales, zeros, group_size, bias, activation=activation)


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
    """Run one kernel. `kernel` ("gemv", "dot" or "dequantize": the weight dequantized to x's dtype
    in one pass, then cuBLAS), `config` and `split_k` override the choice by shape (for tests and
    tuning). `activation` ("silu" or "gelu_tanh"; one row): `int4_gated_gemv`."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    if activation is not None:
        kernel, split_k, N = "gemv", 1, N // 2  # the activation needs whole sums of gate and up
    x = x if x.stride(-1) == 1 else x.contiguous()  # read only: a copy changes nothing the caller sees
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0 or K == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], N)
    k_cap = group_size & -group_size  # the widest tile inside one group
    if kernel is None:
        kernel = "gemv" if M <= _GEMV_MAX_M or k_cap < _MIN_DOT else "dot"
        if k_cap < _WORD or (M >= _DEQUANTIZE_MIN_M and x.is_cuda and x.dtype != torch.float32):
            kernel = "dequantize"
    if kernel == "dequantize":
        weight = _dequantized(qweight, scales, zeros, group_size, x.dtype, pdl)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
    if config is None:
        config = _gemv_config(N, K, k_cap) if kernel == "gemv" else _dot_config(M, k_cap)
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
        config.setdefault("GROUPS", max(1, block_k // group_size))
        tiles = M * triton.cdiv(N, config["BLOCK_N"])
    else:
        tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    k_per_split = _k_per_split(kernel, config, tiles, M, K, split_k, x.device)
    splits = triton.cdiv(K, k_per_split)
    target = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
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
        HAS_BIAS=bias is not None and splits == 1,
        **config,
    )
    common["PRMT"] = x.is_cuda and common.get("PRMT", True)
    if kernel == "gemv":
        _int4_gemv_kernel[(M, triton.cdiv(N, config["BLOCK_N"]), splits)](
            *args,
            N,
            K,
            *strides,
            **common,
            EXACT=x.dtype == torch.float32,
            GATED=activation is not None,
            GELU_TANH=activation == "gelu_tanh",
        )
    else:
        native = x.is_cuda and x.dtype != torch.float32
        _int4_dot_kernel[(tiles, splits)](*args, M, N, K, *strides, **common, NATIVE_DOT=native)
    if splits > 1:
        block = 1024
        partial_sums = (target, bias if bias is not None else target, out, M * N, N)
        _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
            *partial_sums, SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **options
        )
    return out.view(*x.shape[:-1], N)


def _k_per_split(kernel: str, config: dict, tiles: int, M: int, K: int, split_k: int | None, device) -> int:
    """Columns a program of `tiles` output tiles reads: K / `split_k` in whole tiles where given,
    else the GEMV's `_gemv_splits` in whole unrolled steps, or the tensor-core kernel's 8-bit rule."""
    block_k = config["BLOCK_K"]
    if split_k is not None:
        return triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    if kernel == "gemv":
        unit = block_k * config["UNROLL"]  # whole unrolled steps: as many bytes a split
        return triton.cdiv(triton.cdiv(K, _gemv_splits(tiles, K, unit, num_sms(device))), unit) * unit
    # Decode batches: at most ~4096 columns a program (deep layers such as down_proj).
    min_splits = min(triton.cdiv(K, 4096) if M <= 64 else 1, _MAX_SPLIT_K)
    return _split_k(tiles, K, block_k, num_sms(device), min_splits)[1]


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


def _gemv_config(N: int, K: int, k_cap: int) -> dict:
    """Tiles of 8192 weights inside one group (64 rows x 128 columns for groups of 128) with 4
    warps, the loop unrolled to 512 columns a step, K split by `_gemv_splits`. A sweep on an
    H200 (docs/benchmarks/quantization.md#the-one-row-gemvs-tiles) found tiles of whole groups
    faster alone (16 x 1024 for q|k|v and o, 16 x 512 with 8 warps for gate|up with its
    activation), but Qwen3-8B decoded slower with them (258.8 tok/s, where this took 287.3)."""
    block_k = min(k_cap, 256)
    block_n = max(16, min(256, 8192 // block_k))
    # A grid's second dimension holds at most 65535 programs (an LM head of 2^22 rows).
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, 65535)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=max(1, 512 // block_k), num_warps=4, num_stages=1)


def _gemv_splits(tiles: int, K: int, split_unit: int, num_sms: int) -> int:
    """K splits for the GEMV: doubled while the programs number fewer than two a SM (its tiles are
    twice the 8-bit GEMV's bytes, so fewer programs cover a weight), each split keeping a whole
    unrolled step. Not yet measured: the 8-bit rule (quantized_linear._split_k) stops at half
    the SMs."""
    splits = 1
    while splits < _MAX_SPLIT_K and tiles * splits < 2 * num_sms and K // (2 * splits) >= split_unit:
        splits *= 2
    return splits


def _dot_config(M: int, k_cap: int) -> dict:
    """quantized_linear._dot_config's tiles (not yet swept for 4 bits) but for decode batches (M
    <= 64) 64 weight rows a tile where 8 bits take 32: in the SASS for sm_90 (Triton 3.9, groups
    of 128, 16 rows of x, 4 warps) a 32 x 128 weight tile's loop body is 249 instructions a
    thread for its 32 weights, a 64 x 128 one's 351 for 64, a 128 x 128 one's 581 for 128 (the
    dequantized tile goes to the MMA's operand layout through shared memory). More rows of x:
    128 x 128 tiles, 128 columns deep."""
    if M <= 64:
        block_m = max(_MIN_DOT, triton.next_power_of_2(M))
        return dict(
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=min(256, k_cap), GROUP_N=8, num_warps=4, num_stages=4
        )
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=min(128, k_cap), GROUP_N=8, num_warps=8, num_stages=3)


def _check_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2D uint8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    N, K = qweight.shape[0], qweight.shape[1] * 2
    if group_size < 2 or group_size % 2 or K % group_size:
        raise ValueError(f"group_size must be even and divide K = {K}, got {group_size}")
    groups = (N, K // group_size)
    check_dtype("scales", scales)
    if tuple(scales.shape) != groups:
        raise ValueError(f"scales must be {list(groups)}, got {list(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != groups):
        raise ValueError(f"zeros must be uint8 {list(groups)}, got {zeros.dtype} {list(zeros.shape)}")


def _check_gated(x, qweight, scales, zeros, group_size, bias, activation) -> None:
    _check(x, qweight, scales, zeros, group_size, bias)
    if x.numel() != qweight.shape[1] * 2:
        raise ValueError(f"x must be one row of K = {qweight.shape[1] * 2}, got x of shape {list(x.shape)}")
    _check_gate_up(qweight, activation)


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> None:
    check_dtype("x", x)
    _check_weight(qweight, scales, zeros, group_size)
    K = qweight.shape[1] * 2
    if x.shape[-1] != K:
        raise ValueError(f"x's last dim must be K = {K}, got {x.shape[-1]}")
    if bias is not None and tuple(bias.shape) != (qweight.shape[0],):
        raise ValueError(f"bias must be [{qweight.shape[0]}], got {list(bias.shape)}")
    tensors = {"x": x, "qweight": qweight, "scales": scales}
    if zeros is not None:
        tensors["zeros"] = zeros
    if bias is not None:
        tensors["bias"] = bias
    check_same_device(**tensors)
