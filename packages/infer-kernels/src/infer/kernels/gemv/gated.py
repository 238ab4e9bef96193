"""A gated MLP's gate/up projection and its activation for one row, in one kernel, for each weight
format: `gated_gemv` (dense), `quantized_gated_gemv` (8-bit), `int4_gated_gemv` (4-bit).

The weight is `[gate; up]`, `[2N, K]`; each program of the format's GEMV streams the up rows of
its gate rows too and writes `act(gate) * up` (`activation` "silu" or "gelu_tanh"). The fused
kernel reads the same weight bytes as the plain GEMV and saves the activation's kernel and the
`[2N]` intermediate; gate and up are rounded to x's dtype before the activation, as the two ops
store them, so the result is the unfused pair's.
"""

import torch

from infer.kernels._dispatch import use_triton
from infer.kernels.gemv.dense import _launch as _launch_dense
from infer.kernels.gemv.int4_linear import _WORD
from infer.kernels.gemv.int4_linear import _launch as _launch_int4
from infer.kernels.gemv.quantized import _launch as _launch_8bit
from infer.kernels.gemv.references import (
    _check_gated,
    _check_int4_gated,
    _check_quantized_gated,
    gated_gemv_ref,
    int4_gated_gemv_ref,
    quantized_gated_gemv_ref,
)


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
        return _launch_dense(x, weight, bias, activation=activation, pdl=pdl)
    return gated_gemv_ref(x, weight, bias, activation=activation)


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
        return _launch_8bit(x, weight, scale, tuple(block_size), bias, activation=activation, pdl=pdl)
    return quantized_gated_gemv_ref(x, weight, scale, block_size, bias, activation=activation)


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
    """`quantized_gated_gemv` for a 4-bit `[gate; up]` weight (2N rows, int4_layout):
    `act(gate) * up` of one row x in one kernel, gate and up rounded to x's dtype first, as
    `int4_linear` and the activation op store them."""
    _check_int4_gated(x, qweight, scales, zeros, group_size, bias, activation)
    if use_triton(x) and qweight.numel() > 0 and group_size & -group_size >= _WORD:
        return _launch_int4(x, qweight, scales, zeros, group_size, bias, activation=activation, pdl=pdl)
    return int4_gated_gemv_ref(x, qweight, scales, zeros, group_size, bias, activation=activation)
