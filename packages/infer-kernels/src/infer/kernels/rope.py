"""Rotary position embedding, applied in place to q and k (GPT-NeoX "rotate half" layout).

Tables: `cos` and `sin` hold one row per position and `head_dim // 2` columns (the distinct
frequencies); Llama 3 frequency scaling and Gemma 3's local/global bases are decided when the
tables are built (`rope_tables`, rotary_tables.py), never inside the kernel.

Shapes: q is `[..., num_q_heads, head_dim]`, k is `[..., num_kv_heads, head_dim]` with the same
leading (token) dims. Either the tables are 2D `[max_pos, head_dim // 2]` and `positions` (shape
= the leading dims) picks a row per token, or they are already per token with shape
`[*leading, head_dim // 2]` and `positions` is None. Each token carries its own position, so
prefill rows and decode rows of different sequences mix freely in one call.

Layout: q and k may be `[T, H, D]` or `[B, T, H, D]` with any strides except the last, which
must be 1: the views `qkv[..., :q_size].view(B, T, Hq, D)` of a fused qkv projection are rotated
in place without a copy.

On a CPU, `rope_cpu` rotates fp32 q and k in five ops each (multiplies and fused multiply-adds
written in place) where the reference takes nine; other dtypes take the reference.

The Triton kernel gives each token two programs, each of which reads its cos/sin row once: one
rotates all q heads, the other all k heads (at batch-1 decode the two chains of loads then wait
side by side). Given a `KVStore` (q and k `[T, H, D]` with positions), the k program also writes
each rotated k and the token's v into the KV cache at the token's slot, as `store_kv` would.
A position outside the table cannot be checked without a device sync, so instead of reading out
of bounds the kernel writes NaN into that token's q and k (loud, never a silent wrong rotation);
the PyTorch path raises IndexError.
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.pdl import await_inputs, launch_options
from infer.kernels.store_kv import KVStore, _cache_row, _store_v, check_store, store_args, store_kv_ref

# Most elements of one head-block tile (heads x head_dim // 2) a program holds at once; more heads
# are walked in a loop, so any head count fits without register spills.
_MAX_TILE = 4096


# seq_len (the step's token count) varies every step; specializing on it (== 1, % 16) would compile
# a new variant mid-serving, see paged_attention/tiles.py.
@triton.jit(do_not_specialize=["seq_len"])
def _rope_kernel(
    q_ptr,
    q_stride_batch,
    q_stride_token,
    q_stride_head,
    k_ptr,
    k_stride_batch,
    k_stride_token,
    k_stride_head,
    v_ptr,
    v_stride_token,
    v_stride_head,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    table_row_stride,
    positions_ptr,
    num_positions,
    seq_len,
    num_q_heads,
    num_kv_heads,
    half_dim,
    poison,
    HAS_POSITIONS: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    batch = token // seq_len
    step = token % seq_len
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half_dim
    # Under PDL, what no kernel of a step writes is read before the wait: the token's position,
    # its row of the (2D, built once) tables and its cache slot. The heads come after it.
    if HAS_POSITIONS:
        position = tl.load(positions_ptr + token).to(tl.int64)
        cos, sin = _table_rows(
            cos_ptr, sin_ptr, table_row_stride, position, num_positions, dims, dim_mask, poison
        )
    cache_row = _cache_row(slot_ptr, token, num_kv_heads, half_dim, STORE_KV)
    await_inputs(PDL)
    if not HAS_POSITIONS:
        # Per-token tables (row i belongs to token i) are made per call, maybe by the kernel before.
        cos, sin = _table_rows(
            cos_ptr, sin_ptr, table_row_stride, token, num_positions, dims, dim_mask, poison
        )
    if tl.program_id(1) == 0:
        q_at = q_ptr + batch * q_stride_batch + step * q_stride_token
        _rotate_heads(
            q_at, q_stride_head, num_q_heads, half_dim, cos, sin, dims, dim_mask, q_at, BLOCK_HQ, False
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
        _rotate_heads(
            k_ptr + batch * k_stride_batch + step * k_stride_token,
            k_stride_head,
            num_kv_heads,
            half_dim,
            cos,
            sin,
            dims,
            dim_mask,
            k_cache_ptr + cache_row,
            BLOCK_HK,
            STORE_KV,
        )


@triton.jit
def _table_rows(cos_ptr, sin_ptr, table_row_stride, position, num_positions, dims, dim_mask, poison):
    """The fp32 cos and sin rows of `position` at `dims`, or `poison` throughout where the position
    is outside the table (never a read out of bounds)."""
    in_table = (position >= 0) & (position < num_positions)
    row = tl.where(in_table, position, 0)
    cos = tl.load(cos_ptr + row * table_row_stride + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * table_row_stride + dims, mask=dim_mask, other=0.0).to(tl.float32)
    return tl.where(in_table, cos, poison), tl.where(in_table, sin, poison)


@triton.jit
def _rotate_heads(
    token_ptr,
    stride_head,
    num_heads,
    half_dim,
    cos,
    sin,
    dims,
    dim_mask,
    cache_ptr,
    BLOCK_H: tl.constexpr,
    STORE: tl.constexpr,
):
    """Rotate one token's heads in place; with STORE, also write them into the contiguous cache
    row at `cache_ptr`."""
    dtype = token_ptr.dtype.element_ty
    for first_head in range(0, num_heads, BLOCK_H):
        heads = first_head + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]
        first_half = token_ptr + heads[:, None] * stride_head + dims[None, :]
        x1 = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first_half + half_dim, mask=mask, other=0.0).to(tl.float32)
        _store_rotated(first_half, half_dim, x1, x2, cos, sin, mask, dtype)
        if STORE:
            cached = cache_ptr + heads[:, None] * (2 * half_dim) + dims[None, :]
            _store_rotated(cached, half_dim, x1, x2, cos, sin, mask, dtype)


@triton.jit
def _store_rotated(first_half, half_dim, x1, x2, cos, sin, mask, dtype):
    """Store the rotation of fp32 halves (x1, x2) of a head tile at `first_half` (and half_dim on)."""
    tl.store(first_half, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first_half + half_dim, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


def _batch_token_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, head) strides of a [T, H, D] or [B, T, H, D] tensor."""
    if t.dim() == 3:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _head_tiles(half_dim: int, num_q_heads: int, num_kv_heads: int) -> dict:
    """Launch settings of a kernel whose program walks one token's heads in tiles of at most
    _MAX_TILE elements (heads x half a head): BLOCK_HALF, BLOCK_HQ, BLOCK_HK and num_warps."""
    block_half = triton.next_power_of_2(half_dim)
    max_heads_per_tile = max(1, _MAX_TILE // block_half)
    block_hq = min(triton.next_power_of_2(num_q_heads), max_heads_per_tile)
    block_hk = min(triton.next_power_of_2(num_kv_heads), max_heads_per_tile)
    return dict(
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        num_warps=8 if block_hq * block_half >= 2048 else 4,
    )


def _launch(q, k, cos, sin, positions, store, pdl):
    half_dim = q.shape[-1] // 2
    seq_len = q.shape[-3]
    num_tokens = q.shape[:-2].numel()
    if num_tokens == 0:
        return q, k
    cos = cos.reshape(-1, half_dim).contiguous()
    sin = sin.reshape(-1, half_dim).contiguous()
    if positions is not None:
        positions = positions.reshape(-1).contiguous()
    # Two programs a token: its q heads, and its k heads with the cache writes. At one token
    # (batch-1 decode) each waits on its own chain of loads, side by side.
    _rope_kernel[(num_tokens, 2)](
        q,
        *_batch_token_strides(q),
        k,
        *_batch_token_strides(k),
        *store_args(store, k),
        cos,
        sin,
        cos.stride(0),
        positions if positions is not None else cos,  # unused without positions
        cos.shape[0],
        seq_len,
        q.shape[-2],
        k.shape[-2],
        half_dim,
        float("nan"),
        HAS_POSITIONS=positions is not None,
        STORE_KV=store is not None,
        **_head_tiles(half_dim, q.shape[-2], k.shape[-2]),
        **launch_options(q, pdl),
    )
    return q, k


def _rotation_rows(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cos/sin rows (the tables' rows at `positions`, or as given), fp32, broadcast
    over heads: `[..., 1, D/2]`."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    return cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _rotation_rows(cos, sin, positions)
    for t in (q, k):
        half = t.shape[-1] // 2
        x1, x2 = t[..., :half].float(), t[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        t.copy_(rotated.to(t.dtype))
    _store(k, store)
    return q, k


def _store(k: torch.Tensor, store: KVStore | None) -> None:
    """The unfused store after a rotation (the reference and CPU paths)."""
    if store is not None:
        store_kv_ref(k, store.v, store.k_cache, store.v_cache, store.slot_mapping)


def rope_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path: the reference's rotation for fp32 q and k in fewer ops; the reference else.

    Where k's heads follow q's in memory (both views of one fused q|k|v projection, as in a
    model without QK norm), they are rotated as one tensor: a CPU pays per op, not per byte."""
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        return rope_ref(q, k, cos, sin, positions, store=store)
    cos, sin = _rotation_rows(cos, sin, positions)
    for t in _heads_as_one(q, k):
        half = t.shape[-1] // 2
        x1, x2 = t[..., :half], t[..., half:]
        rotated_x1 = torch.addcmul(x1 * cos, x2, sin, value=-1)  # x1 cos - x2 sin
        x2.mul_(cos).addcmul_(x1, sin)  # x2 cos + x1 sin, while x1 still holds its input
        x1.copy_(rotated_x1)
    _store(k, store)
    return q, k


def _heads_as_one(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q and k as one `[..., Hq + Hk, D]` view) where k's heads follow q's in memory with the
    same strides; (q, k) otherwise."""
    heads = q.shape[-2]
    if (
        q.shape[:-2] != k.shape[:-2]
        or q.stride() != k.stride()
        or q.stride(-2) != q.shape[-1]
        or k.data_ptr() != q.data_ptr() + heads * q.stride(-2) * q.element_size()
    ):
        return q, k
    shape = (*q.shape[:-2], heads + k.shape[-2], q.shape[-1])
    return (q.as_strided(shape, q.stride(), q.storage_offset()),)


def _check(q, k, cos, sin, positions, store) -> None:
    check_dtype("q", q)
    check_dtype("k", k)
    check_dtype("cos", cos)
    check_dtype("sin", sin)
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    for name, t in (("q", q), ("k", k)):
        if t.dim() not in (3, 4):
            raise ValueError(f"{name} must be [T, H, D] or [B, T, H, D], got shape {list(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous head dim (stride 1; it is rotated in place, so it "
                f"cannot be copied), got strides {list(t.stride())}; pass a view whose last dim is contiguous"
            )
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % 2:
        raise ValueError(f"q and k must share an even head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must share leading (token) dims, got {list(q.shape)} and {list(k.shape)}")
    if cos.shape != sin.shape or cos.shape[-1] != q.shape[-1] // 2:
        raise ValueError(
            f"cos and sin must share a shape ending in head_dim // 2 = {q.shape[-1] // 2}, "
            f"got {list(cos.shape)} and {list(sin.shape)}"
        )
    if positions is None:
        if cos.shape[:-1] != q.shape[:-2]:
            raise ValueError(
                f"per-token cos/sin must have shape {list(q.shape[:-2]) + [q.shape[-1] // 2]} "
                f"when positions is None, got {list(cos.shape)}"
            )
    else:
        if cos.dim() != 2:
            raise ValueError(
                f"cos/sin must be 2D [max_pos, head_dim // 2] with positions, got {list(cos.shape)}"
            )
        if positions.shape != q.shape[:-2] or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"positions must be int32/int64 with shape {list(q.shape[:-2])}, "
                f"got {positions.dtype} {list(positions.shape)}"
            )
        check_same_device(q=q, positions=positions)
    if store is not None:
        if positions is None or q.dim() != 3:
            raise ValueError("a KV store needs q and k as [T, H, D] with positions (one slot per token)")
        check_store(k, store)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    store: KVStore | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by their positions; returns (q, k). With `store`, then write the
    rotated k and `store.v` into the caches at their slots (as `store_kv`). `pdl`: launch with
    programmatic dependent launch (infer.kernels.pdl)."""
    _check(q, k, cos, sin, positions, store)
    if use_triton(q):
        return _launch(q, k, cos, sin, positions, store, pdl)
    if q.device.type == "cpu":
        return rope_cpu(q, k, cos, sin, positions, store=store)
    return rope_ref(q, k, cos, sin, positions, store=store)
