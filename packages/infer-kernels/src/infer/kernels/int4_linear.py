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
"""

import torch
import torch.nn.functional as F

from infer.kernels._dispatch import check_dtype, check_same_device

# The zero point of symmetric weights (GPTQ's sym=True): q in 0..15 means q - 8 in -8..7.
SYMMETRIC_ZERO = 8


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
    return int4_linear_ref(x, qweight, scales, zeros, group_size, bias)


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
