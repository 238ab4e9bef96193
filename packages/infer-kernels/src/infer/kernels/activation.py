"""Gated MLP activations on a fused `[..., 2 * intermediate]` gate/up projection.

The first half of the last dim is the gate, the second half the up projection, as produced by
one matmul against the concatenated `[gate_proj; up_proj]` weight.

The Triton kernel reads gate and up once and writes the product once (eager PyTorch makes a
pass per elementwise op); programs tile `(row, column block)`.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, use_triton
from infer.kernels.pdl import await_inputs, launch_options

# 1024 elements per program with 4 warps: 8 per thread, i.e. one 16-byte vector per bf16 load.
_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def gated_activation(gate, up, GELU_TANH: tl.constexpr):
    """`act(gate) * up` in fp32 (SiLU, or GELU's tanh form): the one definition, which the fused
    gate/up GEMV (`gated_gemv`) applies to its outputs too."""
    if GELU_TANH:
        # 0.5 * x * (1 + tanh(z)) == x * sigmoid(2 * z): same function, and tl.sigmoid exists on
        # every backend (tanh is not in triton.language on all supported versions).
        # 0.797... is sqrt(2 / pi).
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        activated = gate * tl.sigmoid(2.0 * z)
    else:
        activated = gate * tl.sigmoid(gate)
    return activated * up


@triton.jit
def _gated_activation_kernel(
    gate_up_ptr,
    gate_up_row_stride,
    out_ptr,
    out_row_stride,
    num_cols,
    GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + num_cols, mask=mask, other=0.0).to(tl.float32)
    out = gated_activation(gate, up, GELU_TANH)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(gate_up: torch.Tensor, *, gelu_tanh: bool, pdl: bool) -> torch.Tensor:
    num_cols = gate_up.shape[-1] // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()  # read only: a copy changes nothing the caller sees
    rows = gate_up.reshape(-1, 2 * num_cols)
    out = torch.empty((rows.shape[0], num_cols), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() > 0:
        grid = (rows.shape[0], triton.cdiv(num_cols, _BLOCK))
        _gated_activation_kernel[grid](
            rows,
            rows.stride(0),
            out,
            out.stride(0),
            num_cols,
            GELU_TANH=gelu_tanh,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
            **launch_options(rows, pdl),
        )
    return out.view(*gate_up.shape[:-1], num_cols)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def _check(gate_up: torch.Tensor) -> None:
    check_dtype("gate_up", gate_up)
    if gate_up.dim() == 0:
        raise ValueError("gate_up must have at least one dim (gate and up halves), got a scalar")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up halves), got {gate_up.shape[-1]}")


def silu_and_mul(gate_up: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up`. `pdl`: launch with programmatic dependent launch (infer.kernels.pdl)."""
    _check(gate_up)
    if use_triton(gate_up):
        return _launch(gate_up, gelu_tanh=False, pdl=pdl)
    return silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma): `gelu_tanh(gate) * up`. `pdl`: as silu_and_mul's."""
    _check(gate_up)
    if use_triton(gate_up):
        return _launch(gate_up, gelu_tanh=True, pdl=pdl)
    return gelu_tanh_and_mul_ref(gate_up)
