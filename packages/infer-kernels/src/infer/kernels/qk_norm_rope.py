"""Per-head RMSNorm of q and k, then the rotary embedding, in place and in one pass (QK norm).

Qwen 3 and Gemma 3 normalise each head of q and of k (one weight of `head_dim` for all q heads,
another for all k heads) before rotating them. Unfused, that is three kernels a layer (two
`rms_norm`, one `rope`), each reading and writing the heads; at batch 1 each also costs its
launch, which is what a decode step is made of (docs/benchmarks/generation.md#elsewhere). Here two programs
per token normalise and rotate all of its q heads, and all of its k heads.

The result is that of `rms_norm` of each head, rounded to the input dtype as the unfused kernel
stores it, then `rope` of the rounded heads: `qk_norm_rope_ref` composes the two references.
Shapes as `rope`'s with positions: q `[T, Hq, D]`, k `[T, Hk, D]` (any strides but the last,
so views of a fused q|k|v projection are updated in place), tables `[max_pos, D // 2]`,
positions `[T]`. A position outside the table writes NaN into that token's q and k, as `rope`
does. Given a `KVStore`, the k program also writes the rotated k and the token's v into the KV
cache at its slot, as `store_kv` would (one kernel a layer instead of four).
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.pdl import await_inputs, launch_options
from infer.kernels.rms_norm import _norm_scale, rms_norm_ref
from infer.kernels.rope import _head_tiles, _store_rotated, _table_rows, rope_ref
from infer.kernels.store_kv import KVStore, _cache_row, _store_v, check_store, store_args


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    q_stride_token,
    q_stride_head,
    k_ptr,
    k_stride_token,
    k_stride_head,
    v_ptr,
    v_stride_token,
    v_stride_head,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    table_row_stride,
    positions_ptr,
    num_positions,
    num_q_heads,
    num_kv_heads,
    half_dim,
    eps,
    offset,
    poison,
    STORE_KV: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    is_q = tl.program_id(1) == 0
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half_dim
    # Under PDL, what no kernel of a step writes is read before the wait: the token's position,
    # its row of the tables, its cache slot and the norm's weight. The heads come after it.
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = _table_rows(
        cos_ptr, sin_ptr, table_row_stride, position, num_positions, dims, dim_mask, poison
    )
    if is_q:
        scale1, scale2 = _head_scales(q_weight_ptr, half_dim, offset, dims, dim_mask)
    else:
        scale1, scale2 = _head_scales(k_weight_ptr, half_dim, offset, dims, dim_mask)
    cache_row = _cache_row(slot_ptr, token, num_kv_heads, half_dim, STORE_KV)
    await_inputs(PDL)
    if is_q:
        q_at = q_ptr + token * q_stride_token
        _norm_and_rotate_heads(
            q_at,
            q_stride_head,
            num_q_heads,
            scale1,
            scale2,
            half_dim,
            eps,
            cos,
            sin,
            dims,
            dim_mask,
            q_at,
            BLOCK_HQ,
            False,
        )
    else:
        _store_v(
            cache_row,
            token,
            v_ptr,
            v_stride_token,
            v_stride_head,
            v_cache_ptr,
            num_kv_heads,
            half_dim,
            dims,
            dim_mask,
            BLOCK_HK,
            STORE_KV,
        )
        _norm_and_rotate_heads(
            k_ptr + token * k_stride_token,
            k_stride_head,
            num_kv_heads,
            scale1,
            scale2,
            half_dim,
            eps,
            cos,
            sin,
            dims,
            dim_mask,
            k_cache_ptr + cache_row,
            BLOCK_HK,
            STORE_KV,
        )


@triton.jit
def _head_scales(weight_ptr, half_dim, offset, dims, dim_mask):
    """The norm's scale (offset + weight) over a head's two halves, in fp32."""
    first = _norm_scale(weight_ptr, dims, dim_mask, offset)
    return first, _norm_scale(weight_ptr + half_dim, dims, dim_mask, offset)


@triton.jit
def _norm_and_rotate_heads(
    token_ptr,
    stride_head,
    num_heads,
    scale1,
    scale2,
    half_dim,
    eps,
    cos,
    sin,
    dims,
    dim_mask,
    cache_ptr,
    BLOCK_H: tl.constexpr,
    STORE: tl.constexpr,
):
    """Normalise and rotate one token's heads in place; with STORE, also write them into the
    contiguous cache row at `cache_ptr`."""
    dtype = token_ptr.dtype.element_ty
    for first_head in range(0, num_heads, BLOCK_H):
        heads = first_head + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]
        first_half = token_ptr + heads[:, None] * stride_head + dims[None, :]
        x1 = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first_half + half_dim, mask=mask, other=0.0).to(tl.float32)
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv_rms = 1.0 / tl.sqrt(squares / (2 * half_dim) + eps)
        # Rounded to the heads' dtype between the two steps, as the unfused norm stores them.
        n1 = (x1 * inv_rms[:, None] * scale1[None, :]).to(dtype).to(tl.float32)
        n2 = (x2 * inv_rms[:, None] * scale2[None, :]).to(dtype).to(tl.float32)
        _store_rotated(first_half, half_dim, n1, n2, cos, sin, mask, dtype)
        if STORE:
            cached = cache_ptr + heads[:, None] * (2 * half_dim) + dims[None, :]
            _store_rotated(cached, half_dim, n1, n2, cos, sin, mask, dtype)


def _launch(q, k, q_weight, k_weight, eps, offset, cos, sin, positions, store, pdl) -> None:
    num_tokens, half_dim = q.shape[0], q.shape[-1] // 2
    if num_tokens == 0:
        return
    # Two programs a token, as rope's: its q heads, and its k heads with the cache writes.
    _qk_norm_rope_kernel[(num_tokens, 2)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        *store_args(store, k),
        q_weight.contiguous(),
        k_weight.contiguous(),
        cos,
        sin,
        cos.stride(0),
        positions.contiguous(),
        cos.shape[0],
        q.shape[1],
        k.shape[1],
        half_dim,
        float(eps),
        float(offset),
        float("nan"),
        STORE_KV=store is not None,
        **_head_tiles(half_dim, q.shape[1], k.shape[1]),
        **launch_options(q, pdl),
    )


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    offset: float = 0.0,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: `rms_norm_ref` of each head written back into q and k, then `rope_ref`
    (which stores k and v when given `store`)."""
    q.copy_(rms_norm_ref(q, q_weight, eps, offset=offset))
    k.copy_(rms_norm_ref(k, k_weight, eps, offset=offset))
    return rope_ref(q, k, cos, sin, positions, store=store)


def _check(q, k, q_weight, k_weight, cos, sin, positions, store) -> None:
    for name, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        check_dtype(name, t)
    check_same_device(q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin, positions=positions)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be [T, H, D] with the same T and D, got {list(q.shape)} and {list(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            f"q and k need an even head_dim with a contiguous last dim (updated in place), got "
            f"head_dim {head_dim}, strides {list(q.stride())} and {list(k.stride())}"
        )
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(
            f"q_weight and k_weight must be [{head_dim}], got {list(q_weight.shape)} and "
            f"{list(k_weight.shape)}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2 or cos.stride(-1) != 1:
        raise ValueError(
            f"cos and sin must be contiguous [max_pos, {head_dim // 2}] tables, got {list(cos.shape)} "
            f"and {list(sin.shape)}"
        )
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int32/int64 of shape [{q.shape[0]}], got {positions.dtype} "
            f"{list(positions.shape)}"
        )
    if store is not None:
        check_store(k, store)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    offset: float = 0.0,
    store: KVStore | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each head of q (scale `offset + q_weight`) and of k (`offset + k_weight`), then
    rotary embedding by `positions`, in place; returns (q, k). With `store`, then write the
    rotated k and `store.v` into the caches at their slots (as `store_kv`). `pdl`: launch with
    programmatic dependent launch (infer.kernels.pdl)."""
    _check(q, k, q_weight, k_weight, cos, sin, positions, store)
    if use_triton(q):
        _launch(q, k, q_weight, k_weight, eps, offset, cos, sin, positions, store, pdl)
        return q, k
    return qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin, positions, offset=offset, store=store)
