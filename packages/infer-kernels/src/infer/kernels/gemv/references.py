"""The GEMV family in plain PyTorch: each op's input checks, which its Triton launcher runs
too, and its reference, the tests' oracle and the CPU path (`*_ref`), with the weights'
dequantization (`dequantize_weight`, `dequantize_int4`).

The references compute in fp32 and round once to x's dtype; the gated ones round gate and up to
x's dtype before the activation, as the unfused projection stores them; the normed ones run the
norm kernels' references on a copy of the residual.
"""

import math

import torch
import torch.nn.functional as F

from infer.kernels._dispatch import check_dtype, check_same_device
from infer.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from infer.kernels.gemv.configs import NORMED_MAX_K
from infer.kernels.gemv.int4_layout import SYMMETRIC_ZERO, unpack_int4
from infer.kernels.rms_norm import add_rms_norm_ref, rms_norm_add_rms_norm_ref

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
_ACTIVATIONS = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}


# One row and a dense weight: gemv, gated_gemv.


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


# 8-bit weights and their scales: quantized_linear, quantized_gated_gemv.


def _check_quantized_weight(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]) -> None:
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


def _check_quantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None,
) -> None:
    check_dtype("x", x)
    _check_quantized_weight(weight, scale, block_size)
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
    _check_quantized_weight(weight, scale, block_size)
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
    _check_quantized(x, weight, scale, block_size, bias)
    y = F.linear(x.float(), dequantize_weight(weight, scale, block_size, torch.float32))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _check_quantized_gated(x, weight, scale, block_size, bias, activation) -> None:
    _check_quantized(x, weight, scale, block_size, bias)
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


# 4-bit weights (int4_layout): int4_linear, int4_gated_gemv.


def _check_int4_weight(
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


def _check_int4_gated(x, qweight, scales, zeros, group_size, bias, activation) -> None:
    _check_int4(x, qweight, scales, zeros, group_size, bias)
    if x.numel() != qweight.shape[1] * 2:
        raise ValueError(f"x must be one row of K = {qweight.shape[1] * 2}, got x of shape {list(x.shape)}")
    _check_gate_up(qweight, activation)


def _check_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> None:
    check_dtype("x", x)
    _check_int4_weight(qweight, scales, zeros, group_size)
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


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The `[N, K]` weight the packed one means, computed in fp32 and rounded once to `dtype`."""
    _check_int4_weight(qweight, scales, zeros, group_size)
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
    _check_int4(x, qweight, scales, zeros, group_size, bias)
    weight = dequantize_int4(qweight, scales, zeros, group_size)
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(x.dtype)


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
    _check_int4_gated(x, qweight, scales, zeros, group_size, bias, activation)
    return _ACTIVATIONS[activation](int4_linear_ref(x, qweight, scales, zeros, group_size, bias))


# A pre-norm and the projection after it: normed_gemv, normed_gated_gemv.


def _check_normed(x, residual, norm_weight, weight, x_norm_weight) -> None:
    check_dtype("x", x)
    K = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or x.numel() != K:
        raise ValueError(f"x must be one row, got shape {list(x.shape)}")
    if K > NORMED_MAX_K:
        raise ValueError(f"x's row must hold at most {NORMED_MAX_K} values (one weight tile), got {K}")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x ({x.dtype} {list(x.shape)}), got {residual.dtype} {list(residual.shape)}"
        )
    if weight.dtype != x.dtype or weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous [N, {K}] {x.dtype} tensor, got {weight.dtype} of shape "
            f"{list(weight.shape)} with strides {list(weight.stride())}"
        )
    norms = {"norm_weight": norm_weight} | ({} if x_norm_weight is None else {"x_norm_weight": x_norm_weight})
    for name, w in norms.items():
        check_dtype(name, w)
        if tuple(w.shape) != (K,):
            raise ValueError(f"{name} must have shape [{K}], got {list(w.shape)}")
    check_same_device(x=x, residual=residual, weight=weight, **norms)


def _normed_row_ref(
    x, residual, norm_weight, eps, offset, x_norm_weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed row, the new residual) from the norm kernels' references on a copy of the
    residual: `add_rms_norm_ref`, or with `x_norm_weight` `rms_norm_add_rms_norm_ref`."""
    if x_norm_weight is None:
        return add_rms_norm_ref(x, residual.clone(), norm_weight, eps, offset=offset)
    return rms_norm_add_rms_norm_ref(x, residual.clone(), x_norm_weight, norm_weight, eps, offset=offset)


def normed_gemv_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    x_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the norm kernels' references on a copy of the residual, then `gemv_ref`."""
    _check_normed(x, residual, norm_weight, weight, x_norm_weight)
    normed, residual = _normed_row_ref(x, residual, norm_weight, eps, offset, x_norm_weight)
    return gemv_ref(normed, weight), residual


def normed_gated_gemv_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    activation: str,
    offset: float = 0.0,
    x_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused pair's references: the norm kernels' on a copy of the residual, then
    `gated_gemv_ref` (which rounds the normed row to x's dtype, as the kernel does not)."""
    _check_normed(x, residual, norm_weight, weight, x_norm_weight)
    _check_gate_up(weight, activation)
    normed, residual = _normed_row_ref(x, residual, norm_weight, eps, offset, x_norm_weight)
    return gated_gemv_ref(normed, weight, activation=activation), residual
