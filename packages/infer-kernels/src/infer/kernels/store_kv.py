"""Writes this step's keys and values into a block-structured KV cache, one flat slot per token.

The cache of every pool is `[num_blocks, block_size, num_kv_heads, head_dim]` per layer; a
token's flat slot is `block * block_size + offset`, so `k_cache.view(-1, H, D)[slot]` is its row.
`slot_mapping[i]` names the slot of token i. One program copies one token's heads (K and V);
the slots are read on the device, so a CUDA graph can replay the op for any slots.

The ops that produce this step's keys (`rope`, `qk_norm_rope`) can also write them and the
values into the cache on their way out, given a `KVStore`: one kernel fewer per layer, which a
batch-1 decode step pays in launches more than in bytes. `store_kv` is the op on its own, and
the only writer of an fp8 cache (infer.kernels.kv_fp8), which it quantizes on the way in.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.kv_fp8 import fp8_quantize, is_fp8, quantize_fp8_ref
from infer.kernels.pdl import await_inputs, launch_options


@dataclass(frozen=True)
class KVStore:
    """Where an op that writes this step's keys also stores them and the values: the layer's
    caches and each token's flat slot, as `store_kv` takes them."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def store_args(store: KVStore | None, k: torch.Tensor) -> tuple:
    """The six kernel arguments of `store` (v, its token and head strides, the two caches, the
    slots) for a kernel that writes through it; without one, k stands in for each tensor (the
    kernel reads none of them then)."""
    if store is None:
        return k, k.stride(0), k.stride(1), k, k, k
    v = store.v
    return v, v.stride(0), v.stride(1), store.k_cache, store.v_cache, store.slot_mapping.contiguous()


@triton.jit
def _cache_row(slot_ptr, token, num_kv_heads, half_dim, STORE: tl.constexpr):
    """With STORE: the offset of the token's slot's row in the (contiguous) caches, where the
    caller writes the token's v and rotated k. Without: 0, and nothing is read."""
    cache_row = 0
    if STORE:
        cache_row = tl.load(slot_ptr + token).to(tl.int64) * num_kv_heads * 2 * half_dim
    return cache_row


@triton.jit
def _store_v(
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
    BLOCK_H: tl.constexpr,
    STORE: tl.constexpr,
):
    """With STORE: copy the token's v heads into the v cache's row at `cache_row`
    (`_cache_row`). Without: nothing."""
    if STORE:
        v_at = v_ptr + token * v_stride_token
        _copy_heads(
            v_at, v_stride_head, num_kv_heads, v_cache_ptr + cache_row, half_dim, dims, dim_mask, BLOCK_H
        )


@triton.jit
def _copy_heads(src_ptr, stride_head, num_heads, dst_ptr, half_dim, dims, dim_mask, BLOCK_H: tl.constexpr):
    """Copy one token's heads (`stride_head` apart at `src_ptr`) into a contiguous cache row at
    `dst_ptr`, BLOCK_H heads at a time in two halves of `dims` (the tile rope kernels use)."""
    for first_head in range(0, num_heads, BLOCK_H):
        heads = first_head + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]
        src = src_ptr + heads[:, None] * stride_head + dims[None, :]
        dst = dst_ptr + heads[:, None] * (2 * half_dim) + dims[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
        tl.store(dst + half_dim, tl.load(src + half_dim, mask=mask), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    k_stride_token,
    k_stride_head,
    v_stride_token,
    v_stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    # The cache is contiguous: a slot's row is NUM_HEADS * HEAD_DIM elements.
    cache_at = slot * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(k_ptr + token * k_stride_token + heads[:, None] * k_stride_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * v_stride_token + heads[:, None] * v_stride_head + dims[None, :], mask=mask)
    if FP8:
        # Each head's vector with its own scale (kv_fp8): the scales are [slots, NUM_HEADS].
        scale_at = slot * NUM_HEADS + heads
        k, k_scale = fp8_quantize(k, mask)
        v, v_scale = fp8_quantize(v, mask)
        tl.store(k_scale_ptr + scale_at, k_scale, mask=heads < NUM_HEADS)
        tl.store(v_scale_ptr + scale_at, v_scale, mask=heads < NUM_HEADS)
    tl.store(k_cache_ptr + cache_at, k, mask=mask)
    tl.store(v_cache_ptr + cache_at, v, mask=mask)


def _launch(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, pdl) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()  # read only: a copy changes nothing the caller sees
    if v.stride(-1) != 1:
        v = v.contiguous()
    fp8 = k_scales is not None
    if num_tokens:
        _store_kv_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            # Any pointer without scales: the kernel does not read them then.
            k_scales if fp8 else k_cache,
            v_scales if fp8 else v_cache,
            slot_mapping.contiguous(),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            DIM_PAD=triton.next_power_of_2(head_dim),
            FP8=fp8,
            num_warps=4 if num_heads * head_dim >= 2048 else 1,
            **launch_options(k, pdl),
        )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """The reference: index_copy_ into the caches' flat `[slots, H, D]` views (fp8 caches: of
    kv_fp8's values and scale bytes, copied as bytes)."""
    num_heads, head_dim = k_cache.shape[2:]
    slots = slot_mapping.long()
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        if scales is None:
            cache.view(-1, num_heads, head_dim).index_copy_(0, slots, x)
            continue
        values, scale_bytes = quantize_fp8_ref(x)
        cache.view(torch.uint8).view(-1, num_heads, head_dim).index_copy_(0, slots, values.view(torch.uint8))
        scales.view(-1, num_heads).index_copy_(0, slots, scale_bytes)


def check_store(k: torch.Tensor, store: KVStore) -> None:
    """`store_kv`'s checks for the k an op will write through `store` (not an fp8 cache: that
    takes `store_kv` and its scales)."""
    _check(k, store.v, store.k_cache, store.v_cache, store.slot_mapping, None, None)


def check_fp8_scales(k_cache, v_cache, k_scales, v_scales) -> None:
    """An fp8 cache comes with its scale bytes (kv_fp8), uint8 `[num_blocks, block_size, Hkv]`
    and contiguous; any other cache without."""
    if not is_fp8(k_cache.dtype):
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_scales and v_scales are for float8_e4m3fn caches, not {k_cache.dtype}")
        return
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if t is None:
            raise ValueError(f"a float8_e4m3fn cache needs {name} (uint8 [num_blocks, block_size, kv_heads])")
        if t.dtype != torch.uint8 or t.shape != k_cache.shape[:3] or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous uint8 tensor {tuple(k_cache.shape[:3])}, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    check_same_device(k_cache=k_cache, k_scales=k_scales, v_scales=v_scales)


def _check(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales) -> None:
    for name, t in (("k", k), ("v", v)):
        check_dtype(name, t)
    if not is_fp8(k_cache.dtype):
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_dtype(name, t)
    check_fp8_scales(k_cache, v_cache, k_scales, v_scales)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous (slots are flat row indices into them)")
    expected = ("N", *k_cache.shape[2:])
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != tuple(k_cache.shape[2:]) or t.shape[0] != k.shape[0]:
            raise ValueError(
                f"{name} must be [N, num_kv_heads, head_dim] = {expected} like the cache and the other "
                f"of k/v, got {tuple(t.shape)}"
            )
        if t.dtype != k.dtype or (t.dtype != k_cache.dtype and not is_fp8(k_cache.dtype)):
            raise ValueError(f"{name} must have the cache's dtype {k_cache.dtype}, got {t.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be an int64 (or int32) tensor of shape ({k.shape[0]},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    pdl: bool = False,
) -> None:
    """Write k[i], v[i] (`[N, Hkv, D]`) into flat slot slot_mapping[i] of the caches
    `[num_blocks, block_size, Hkv, D]`, in place. `pdl`: launch with programmatic dependent
    launch (infer.kernels.pdl).

    float8_e4m3fn caches (infer.kernels.kv_fp8) take each head's vector quantized with a scale of
    its own, whose byte goes to the same slot of `k_scales` / `v_scales` (uint8 `[num_blocks,
    block_size, Hkv]`); k and v stay in their own dtype.

    The caller keeps every slot in `0..num_blocks * block_size - 1`: slots are read on the device
    (no host sync), so they are not checked.
    """
    _check(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if use_triton(k):
        _launch(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, pdl)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)
