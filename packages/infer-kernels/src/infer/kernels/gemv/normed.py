"""A pre-norm block's norm and the projection after it, for one row, in one kernel:
`gemv(add_rms_norm(x, residual, norm_weight), weight)` and the new residual; with
`x_norm_weight`, x is normalised first (`rms_norm_add_rms_norm`, Gemma's sandwich norm joining
the residual).

At batch-1 decode the norm is a kernel of one program over a row of 1-2k values, between two GEMVs:
under programmatic dependent launch it adds 1.1-1.4 µs a call to the critical path of a step on an
H200 (docs/benchmarks/generation.md#pre-norm-inside-the-next-gemv), mostly waiting for the kernel
before and being waited for by the next. Here every program of the GEMV normalises the row itself
after its wait: a few kilobytes from L2 and one or two reductions, instead of a kernel.

Only for rows of at most NORMED_MAX_K values, which one weight tile spans: the row is then loaded once,
whole, and its norm is at hand for the tile's product (the dense GEMV takes one tile of all of K
there as well, `_dense_gemv_config`). The arithmetic and its roundings are the unfused kernels'
(`rms_norm`'s, then `gemv`'s): the sum is rounded to the residual's dtype before it is normalised,
and the normalised row to x's dtype before the product.

The residual is not updated in place: other programs may still be reading it, so program 0 writes
the new residual to a new tensor.

`normed_gated_gemv` does the same for a gated MLP's gate/up projection and its activation, on the
gated GEMV's tiles, K in a loop: there the inverse RMS scales each row's sums at the end, so the
loop waits on nothing more than `gated_gemv`'s does, and the normalised row is never rounded to
x's dtype (its one difference from the unfused kernels).
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import num_sms, use_triton
from infer.kernels.gemv.configs import (
    _NORMED_BLOCK_N,
    _NORMED_GATED_BLOCK_K,
    _NORMED_GATED_BLOCK_N,
    _NORMED_GATED_NUM_WARPS,
    _NORMED_GATED_PROGRAMS_PER_SM,
    _NORMED_NUM_WARPS,
)
from infer.kernels.gemv.references import (
    _check_gate_up,
    _check_normed,
    normed_gated_gemv_ref,
    normed_gemv_ref,
)
from infer.kernels.gemv.streaming import gated_rows
from infer.kernels.pdl import await_inputs, launch_options
from infer.kernels.rms_norm import _norm_scale, _scaled_rms_norm


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


@triton.jit
def _normed_gated_tile(
    gate_acc,
    up_acc,
    squares,
    gate,
    up,
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    x_norm_weight_ptr,
    norm_weight_ptr,
    x_inv_rms,
    cols,
    col_mask,
    offset,
    WRITE_RESIDUAL,
    NORM_X_FIRST: tl.constexpr,
):
    """One K tile: the new residual's columns (rounded as the norm kernels round them, and
    written where WRITE_RESIDUAL), their squares summed, and the products with the residual
    scaled by the norm's weight, not yet by its inverse RMS."""
    x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
    residual = tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if NORM_X_FIRST:
        x_scale = _norm_scale(x_norm_weight_ptr, cols, col_mask, offset)
        x = (x.to(tl.float32) * x_inv_rms * x_scale).to(x_ptr.dtype.element_ty)
    summed = (x.to(tl.float32) + residual).to(residual_out_ptr.dtype.element_ty)
    if WRITE_RESIDUAL:
        tl.store(residual_out_ptr + cols, summed, mask=col_mask)
    summed = summed.to(tl.float32)
    squares += summed * summed
    scaled = summed * _norm_scale(norm_weight_ptr, cols, col_mask, offset)
    gate_acc += gate.to(tl.float32) * scaled[None, :]
    up_acc += up.to(tl.float32) * scaled[None, :]
    return gate_acc, up_acc, squares


@triton.jit
def _normed_gated_gemv_kernel(
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
    GELU_TANH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW: tl.constexpr,
    PDL: tl.constexpr,
):
    """`act(gate) * up` of the normed row, N gate rows then N up rows, BLOCK_N of each a program.

    RMSNorm is a per-row scale, so `w . (h * s / rms(h))` = `(w . (h * s)) / rms(h)`: each K
    tile multiplies its weights by the new residual h scaled by the norm's weight s, and adds up
    h's squares beside; the inverse RMS scales the two sums at the end. The loop then waits on
    nothing the plain gated GEMV's does not. (The normed row is not rounded to x's dtype before
    the product, as the unfused norm stores it: the one difference from the unfused pair.)
    With NORM_X_FIRST (Gemma's sandwich norm joining the residual) x's own inverse RMS comes
    first, from the whole row (ROW columns), while the first weight tile is in flight."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < K
    gate_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    up_ptrs = gate_ptrs + N.to(tl.int64) * K
    # Before the wait, the first weight tile (no kernel of the step writes a weight).
    gate = tl.load(gate_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    up = tl.load(up_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    await_inputs(PDL)
    x_inv_rms = 1.0
    if NORM_X_FIRST:
        row_cols = tl.arange(0, ROW)
        row = tl.load(x_ptr + row_cols, mask=row_cols < K, other=0.0).to(tl.float32)
        x_inv_rms = 1.0 / tl.sqrt(tl.sum(row * row, axis=0) / K + eps)
    gate_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    gate_acc, up_acc, squares = _normed_gated_tile(
        gate_acc,
        up_acc,
        squares,
        gate,
        up,
        x_ptr,
        residual_ptr,
        residual_out_ptr,
        x_norm_weight_ptr,
        norm_weight_ptr,
        x_inv_rms,
        cols,
        col_mask,
        offset,
        tile == 0,
        NORM_X_FIRST,
    )
    for _k0 in tl.range(BLOCK_K, K, BLOCK_K):
        cols += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        col_mask = cols < K
        gate = tl.load(gate_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        up = tl.load(up_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        gate_acc, up_acc, squares = _normed_gated_tile(
            gate_acc,
            up_acc,
            squares,
            gate,
            up,
            x_ptr,
            residual_ptr,
            residual_out_ptr,
            x_norm_weight_ptr,
            norm_weight_ptr,
            x_inv_rms,
            cols,
            col_mask,
            offset,
            tile == 0,
            NORM_X_FIRST,
        )
    inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    gate_y = tl.sum(gate_acc, axis=1) * inv_rms
    up_y = tl.sum(up_acc, axis=1) * inv_rms
    out_type = out_ptr.dtype.element_ty
    y = gated_rows(gate_y, up_y, out_ptr, 0, rows, row_mask, out_type, False, GELU_TANH)  # no bias
    tl.store(out_ptr + rows, y.to(out_type), mask=row_mask)


def normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    x_norm_weight: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`normed @ weight.T`, the new residual) for one row x of K <= NORMED_MAX_K values, where the new
    residual is `residual + x` (with `x_norm_weight`: `residual + rms_norm(x, x_norm_weight)`) and
    `normed` its RMSNorm scaled by `offset + norm_weight`. `residual` is left as it is. `pdl`:
    launch with programmatic dependent launch (infer.kernels.pdl)."""
    _check_normed(x, residual, norm_weight, weight, x_norm_weight)
    if not use_triton(x) or weight.numel() == 0:  # no program would write the residual
        return normed_gemv_ref(
            x, residual, norm_weight, weight, eps, offset=offset, x_norm_weight=x_norm_weight
        )
    N, K = weight.shape
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(residual)
    _normed_gemv_kernel[(triton.cdiv(N, _NORMED_BLOCK_N),)](
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
        BLOCK_N=_NORMED_BLOCK_N,
        BLOCK_K=max(triton.next_power_of_2(K), 16),
        num_warps=_NORMED_NUM_WARPS,
        **launch_options(x, pdl),
    )
    return out, residual_out


def normed_gated_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    activation: str,
    offset: float = 0.0,
    x_norm_weight: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`normed_gemv` for a gate/up weight `[2N, K]` with its activation: (`act(gate) * up` of the
    normed row, the new residual), in one kernel (`_normed_gated_gemv_kernel`)."""
    _check_normed(x, residual, norm_weight, weight, x_norm_weight)
    _check_gate_up(weight, activation)
    if not use_triton(x) or weight.numel() == 0:
        return normed_gated_gemv_ref(
            x,
            residual,
            norm_weight,
            weight,
            eps,
            activation=activation,
            offset=offset,
            x_norm_weight=x_norm_weight,
        )
    N, K = weight.shape[0] // 2, weight.shape[1]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(residual)
    _normed_gated_gemv_kernel[(triton.cdiv(N, _NORMED_GATED_BLOCK_N),)](
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
        GELU_TANH=activation == "gelu_tanh",
        BLOCK_N=_NORMED_GATED_BLOCK_N,
        BLOCK_K=min(_NORMED_GATED_BLOCK_K, max(triton.next_power_of_2(K), 16)),
        ROW=max(triton.next_power_of_2(K), 16),
        num_warps=_NORMED_GATED_NUM_WARPS,
        **launch_options(x, pdl),
    )
    return out, residual_out


def normed_gated_gemv_fills_one_wave(gate_up_rows: int, device: torch.device) -> bool:
    """Whether `normed_gated_gemv`'s grid for a gate/up weight of `gate_up_rows` rows is one wave
    of resident programs on `device`: where it is faster than the norm's kernel and `gated_gemv`."""
    programs = triton.cdiv(gate_up_rows // 2, _NORMED_GATED_BLOCK_N)
    return programs <= _NORMED_GATED_PROGRAMS_PER_SM * num_sms(device)
