"""A pre-norm block's norm and the projection after it, for one row, in one kernel:
`gemv(add_rms_norm(x, residual, norm_weight), weight)` and the new residual; with
`x_norm_weight`, x is normalised first (`rms_norm_add_rms_norm`, Gemma's sandwich norm joining
the residual).

At batch-1 decode the norm is a kernel of one program over a row of 1-2k values, between two
GEMVs: under programmatic dependent launch it adds 1.1-1.4 µs a call to the critical path of a
step on an H200 (docs/benchmarks/generation.md), mostly waiting for the kernel before and being
waited for by the next. Here every program of the GEMV normalises the row itself after its wait:
a few kilobytes from L2 and one or two reductions, instead of a kernel.

Only for rows of at most MAX_K values, which one weight tile spans: the row is then loaded once,
whole, and its norm is at hand for the tile's product (the dense GEMV takes one tile of all of K
there as well, `_dense_gemv_config`). The arithmetic and its roundings are the unfused kernels'
(`rms_norm`'s, then `gemv`'s): the sum is rounded to the residual's dtype before it is normalised,
and the normalised row to x's dtype before the product.

The residual is not updated in place: other programs may still be reading it, so program 0 writes
the new residual to a new tensor.
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.pdl import await_inputs, launch_options
from infer.kernels.quantized_linear import gemv_ref
from infer.kernels.rms_norm import _norm_scale, _scaled_rms_norm, add_rms_norm_ref, rms_norm_add_rms_norm_ref

# One tile of the weight spans the row (4 rows x 2048 columns over 8 warps: 32 values a thread).
MAX_K = 2048
_BLOCK_N = 4
_NUM_WARPS = 8


@triton.jit
def _normed_gemv_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    x_norm_weight_ptr,
    norm_weight_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    eps,
    offset,
    NORM_X_FIRST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    col_mask = cols < K
    # Before the wait, what no kernel of the step writes: the weight tile and the norms' weights.
    w = tl.load(
        w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )
    scale = _norm_scale(norm_weight_ptr, cols, col_mask, offset)
    if NORM_X_FIRST:
        x_scale = _norm_scale(x_norm_weight_ptr, cols, col_mask, offset)
    await_inputs(PDL)
    x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
    residual = tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if NORM_X_FIRST:
        x = _scaled_rms_norm(x.to(tl.float32), x_scale, K, eps).to(x_ptr.dtype.element_ty)
    summed = (x.to(tl.float32) + residual).to(residual_out_ptr.dtype.element_ty)
    if tile == 0:
        tl.store(residual_out_ptr + cols, summed, mask=col_mask)
    normed = _scaled_rms_norm(summed.to(tl.float32), scale, K, eps).to(x_ptr.dtype.element_ty)
    y = tl.sum(w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def _check(x, residual, norm_weight, weight, x_norm_weight) -> None:
    check_dtype("x", x)
    K = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or x.numel() != K:
        raise ValueError(f"x must be one row, got shape {list(x.shape)}")
    if K > MAX_K:
        raise ValueError(f"x's row must hold at most {MAX_K} values (one weight tile), got {K}")
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
    _check(x, residual, norm_weight, weight, x_norm_weight)
    residual = residual.clone()
    if x_norm_weight is None:
        normed, residual = add_rms_norm_ref(x, residual, norm_weight, eps, offset=offset)
    else:
        normed, residual = rms_norm_add_rms_norm_ref(
            x, residual, x_norm_weight, norm_weight, eps, offset=offset
        )
    return gemv_ref(normed, weight), residual


def normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    x_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`normed @ weight.T`, the new residual) for one row x of K <= MAX_K values, where the new
    residual is `residual + x` (with `x_norm_weight`: `residual + rms_norm(x, x_norm_weight)`) and
    `normed` its RMSNorm scaled by `offset + norm_weight`. `residual` is left as it is."""
    _check(x, residual, norm_weight, weight, x_norm_weight)
    if not use_triton(x) or weight.numel() == 0:  # no program would write the residual
        return normed_gemv_ref(
            x, residual, norm_weight, weight, eps, offset=offset, x_norm_weight=x_norm_weight
        )
    N, K = weight.shape
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(residual)
    _normed_gemv_kernel[(triton.cdiv(N, _BLOCK_N),)](
        x.contiguous(),
        residual.contiguous(),
        residual_out,
        (x_norm_weight if x_norm_weight is not None else norm_weight).contiguous(),
        norm_weight.contiguous(),
        weight,
        out,
        N,
        K,
        float(eps),
        float(offset),
        NORM_X_FIRST=x_norm_weight is not None,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=max(triton.next_power_of_2(K), 16),
        num_warps=_NUM_WARPS,
        **launch_options(x),
    )
    return out, residual_out
