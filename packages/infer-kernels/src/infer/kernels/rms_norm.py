"""RMSNorm; residual-add + RMSNorm fused in one pass; and RMSNorm + residual-add + RMSNorm in
one pass, the join of Gemma's sandwich norms (a sublayer's post-norm joins the residual, whose
norm is the next sublayer's input): one kernel where the unfused model launches two.

`offset` supports Gemma's `(1 + w)` weight form: the scale applied is `offset + weight`.
Accumulation is in fp32 whatever the input dtype.

On a CPU, `rms_norm_cpu` computes the reference's fp32 arithmetic in four ops, taking the mean
square from the L2 norm (one reduction): a decode step runs two norms a layer, and on a CPU each
op costs a microsecond or more whatever its size. torch's `F.rms_norm` is no faster there: it
decomposes into six ops (7.6 against 5.2 µs a row of 576 on the CI-class machine).

The Triton kernel gives each row to one program and holds the whole row in registers (one read,
one write: the op is memory bound, so the number of passes over HBM is what sets its speed).
"""

import functools

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.pdl import await_inputs, launch_options

# One program holds a whole row; beyond this many elements its registers would spill.
MAX_HIDDEN = 65536


@triton.jit
def _scaled_rms_norm(xf, scale, num_cols, eps):
    """`xf / rms(xf) * scale` in fp32 (`scale`: offset + weight); masked columns of `xf` are 0
    and stay 0."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    return xf * inv_rms * scale


@triton.jit
def _norm_scale(weight_ptr, cols, mask, offset):
    """The scale a norm applies at `cols` (offset + weight), in fp32."""
    return offset + tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_row_stride,
    x_weight_ptr,
    residual_ptr,
    residual_row_stride,
    weight_ptr,
    out_ptr,
    out_row_stride,
    num_cols,
    eps,
    offset,
    NORM_X_FIRST: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # int64 row index: rows * stride overflows int32 beyond 2^31 elements.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    # The weights first, and under PDL before the wait (no kernel writes them): at one row, each
    # load is a trip to HBM that would otherwise follow a reduction.
    scale = _norm_scale(weight_ptr, cols, mask, offset)
    if NORM_X_FIRST:
        x_scale = _norm_scale(x_weight_ptr, cols, mask, offset)
    await_inputs(PDL)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # Read beside x, not after x's norm.
        residual_row = residual_ptr + row * residual_row_stride + cols
        residual = tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
    if NORM_X_FIRST:
        # x's own norm is what joins the residual; rounded to x's dtype, as rms_norm stores it.
        x = _scaled_rms_norm(x.to(tl.float32), x_scale, num_cols, eps).to(x_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
        # Round the sum to the residual's dtype before normalising, as the unfused model does.
        x = (x.to(tl.float32) + residual).to(residual_ptr.dtype.element_ty)
        tl.store(residual_row, x, mask=mask)
    normed = _scaled_rms_norm(x.to(tl.float32), scale, num_cols, eps)
    tl.store(out_ptr + row * out_row_stride + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_settings(num_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(num_cols)
    # Enough warps that each thread holds at most ~16 elements of the row (no register spills).
    num_warps = min(max(block // 512, 4), 32)
    return block, num_warps


def _rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as a 2D [rows, hidden] view with a unit column stride, or a ValueError naming `t`."""
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:  # the leading dims cannot be flattened without a copy
        rows = None
    if rows is None or (rows.stride(-1) != 1 and rows.shape[-1] > 1):
        raise ValueError(
            f"{name} must have a contiguous last dim and rows one stride apart (it is updated in "
            f"place, so it cannot be copied), got shape {list(t.shape)} strides {list(t.stride())}; "
            f"pass a .contiguous() tensor"
        )
    return rows


def _launch(x, residual, weight, eps, offset, *, x_weight=None, pdl=False):
    """rms_norm(x), or with `residual` add_rms_norm, or with both `residual` and `x_weight`
    rms_norm_add_rms_norm (x normalised by `x_weight` first)."""
    num_cols = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()  # read only: a copy changes nothing the caller sees
    x_rows = x.reshape(-1, num_cols)
    residual_rows = _rows_view("residual", residual) if residual is not None else x_rows
    out = torch.empty(x_rows.shape, dtype=x.dtype, device=x.device)
    if x_rows.shape[0] > 0:
        block, num_warps = _launch_settings(num_cols)
        _rms_norm_kernel[(x_rows.shape[0],)](
            x_rows,
            x_rows.stride(0),
            x_weight.contiguous() if x_weight is not None else weight,  # unread without NORM_X_FIRST
            residual_rows,
            residual_rows.stride(0),
            weight.contiguous(),
            out,
            out.stride(0),
            num_cols,
            float(eps),
            float(offset),
            NORM_X_FIRST=x_weight is not None,
            ADD_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
            **launch_options(x_rows, pdl),
        )
    return out.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    # The sum is rounded to the residual's dtype before normalising, as an unfused model does.
    residual.copy_(x + residual)
    return rms_norm_ref(residual, weight, eps, offset=offset), residual


def rms_norm_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    # x's norm is rounded to x's dtype before the add, as the unfused rms_norm returns it.
    return add_rms_norm_ref(
        rms_norm_ref(x, weight, eps, offset=offset), residual, next_weight, eps, offset=offset
    )


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0) -> torch.Tensor:
    """The CPU path: the reference's fp32 arithmetic in few ops (see the module)."""
    x32 = x.float()
    scale = weight.float() + offset if offset else weight.float()
    norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
    inv_rms = torch.addcmul(_scalar(eps), norm, norm, value=1 / x.shape[-1]).rsqrt_()
    return torch.mul(x32, inv_rms).mul_(scale).to(x.dtype)


@functools.cache
def _scalar(value: float) -> torch.Tensor:
    """A CPU float32 scalar tensor, made once per value (an op's tensor operand)."""
    return torch.tensor(value, dtype=torch.float32)


def _check(x: torch.Tensor, **weights: torch.Tensor) -> None:
    check_dtype("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the hidden dim), got a scalar")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"x's last dim must be <= {MAX_HIDDEN} (one row per program), got {x.shape[-1]}")
    for name, weight in weights.items():
        check_dtype(name, weight)
        check_same_device(x=x, **{name: weight})
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{name} must have shape [{x.shape[-1]}] to match x's last dim, got {list(weight.shape)}"
            )


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x and residual must match in shape and dtype, got {list(x.shape)} {x.dtype} "
            f"and {list(residual.shape)} {residual.dtype}"
        )
    check_same_device(x=x, residual=residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0, pdl: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim of `x`: `x / rms(x) * (offset + weight)`, in x's dtype. `pdl`:
    launch with programmatic dependent launch (infer.kernels.pdl), here and in the two below."""
    _check(x, weight=weight)
    if use_triton(x):
        return _launch(x, None, weight, eps, offset, pdl=pdl)
    if x.device.type == "cpu":
        return rms_norm_cpu(x, weight, eps, offset=offset)
    return rms_norm_ref(x, weight, eps, offset=offset)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` in place, then RMSNorm of the new residual. Returns (normed, residual)."""
    _check(x, weight=weight)
    _check_residual(x, residual)
    if use_triton(x):
        _rows_view("residual", residual)  # fail before any write
        return _launch(x, residual, weight, eps, offset, pdl=pdl), residual
    if x.device.type == "cpu":
        residual.add_(x)  # rounded to the residual's dtype before normalising, as the reference
        return rms_norm_cpu(residual, weight, eps, offset=offset), residual
    return add_rms_norm_ref(x, residual, weight, eps, offset=offset)


def rms_norm_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += rms_norm(x, weight)` in place, then RMSNorm of the new residual by
    `next_weight`. Returns (normed, residual). Both norms share `eps` and `offset`."""
    _check(x, weight=weight, next_weight=next_weight)
    _check_residual(x, residual)
    if use_triton(x):
        _rows_view("residual", residual)  # fail before any write
        return _launch(x, residual, next_weight, eps, offset, x_weight=weight, pdl=pdl), residual
    if x.device.type == "cpu":
        # x's norm is rounded to its dtype, then the sum to the residual's, as the reference.
        residual.add_(rms_norm_cpu(x, weight, eps, offset=offset))
        return rms_norm_cpu(residual, next_weight, eps, offset=offset), residual
    return rms_norm_add_rms_norm_ref(x, residual, weight, next_weight, eps, offset=offset)
