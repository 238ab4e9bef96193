"""What the decode and extend kernels share: a key tile's cache slots, addresses and fp8 scales,
and its two products (q . k, probs x v).

Scores, softmax and accumulators are fp32. Dots run in tf32 for bf16/fp16 inputs (tf32 holds
them exactly, on tensor cores) and in full fp32 for fp32 inputs; q.k of both kernels runs in the
inputs' own dtype on CUDA (the same exact products, twice as fast).
"""

import torch
import triton
import triton.language as tl

from infer.kernels.kv_fp8 import fp8_scale

# tl.dot needs every dim to be at least 16: the query heads of a group (1-8) are padded to it.
_MIN_DOT = 16  # Integer arguments that change from step to step (batch shape, block-table width, decode rows)
# are marked do_not_specialize: Triton otherwise compiles a variant for each of their classes
# (== 1, divisible by 16, other) on first sight; under serving that lands mid-run, and every
# stream of that step waits for the compiler.


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _key_slots(block_table_row_ptr, keys_at, in_range, BLOCK_SIZE: tl.constexpr):
    """Flat cache slot of each key index (int64); keys out of range read block 0."""
    block_ids = tl.load(block_table_row_ptr + keys_at // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    return block_ids * BLOCK_SIZE + keys_at % BLOCK_SIZE


@triton.jit
def _key_tile(
    tile_start, end, first, table_row, k_base, v_base, k_stride_slot, v_stride_slot, dims, BLOCK_N, BLOCK_SIZE
):
    """A tile of BLOCK_N keys from `tile_start`: their indices, which are in view (before `end`,
    from `first`), and the addresses of their keys and values."""
    keys_at = tile_start + tl.arange(0, BLOCK_N)
    in_range = keys_at < end
    visible = in_range & (keys_at >= first)
    slots = _key_slots(table_row, keys_at, in_range, BLOCK_SIZE)
    k_ptrs = k_base + slots[:, None] * k_stride_slot + dims[None, :]
    v_ptrs = v_base + slots[:, None] * v_stride_slot + dims[None, :]
    return keys_at, visible, slots, k_ptrs, v_ptrs


@triton.jit
def _key_scales(k_scale_base, v_scale_base, slots, visible, num_kv_heads, FP8: tl.constexpr):
    """With FP8: the float32 scales of a tile's keys and values (kv_fp8; `*_scale_base`: the
    scale bytes of the program's KV head, `num_kv_heads` apart from slot to slot). Without:
    1.0, and nothing is read."""
    if FP8:
        k_scales = fp8_scale(tl.load(k_scale_base + slots * num_kv_heads, mask=visible, other=0))
        v_scales = fp8_scale(tl.load(v_scale_base + slots * num_kv_heads, mask=visible, other=0))
    else:
        k_scales = 1.0
        v_scales = 1.0
    return k_scales, v_scales


@triton.jit
def _scores(q, k, DOT_PRECISION: tl.constexpr, NATIVE_QK: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr):
    """q . k of a tile, unscaled. An e4m3 k converts exactly to q's bf16/fp16 first, or with F16
    to fp16 (one instruction a pair), q with it (bf16 holds fewer bits than fp16)."""
    if NATIVE_QK:
        if FP8 and F16:
            scores = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
        else:
            if FP8:
                k = k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k))
    else:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
    return scores


@triton.jit
def _weighted_values(probs, v, v_scales, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr):
    """probs x v of a tile (fp32). FP8: v's scales applied, to the probabilities, or with F16 to
    v dequantized in fp16, then multiplied in fp16 (as many mantissa bits as tf32)."""
    if FP8 and F16:
        values = v.to(tl.float16) * v_scales[:, None].to(tl.float16)
        return tl.dot(probs.to(tl.float16), values)
    if FP8:
        probs = probs * v_scales[None, :]
    return tl.dot(probs, v.to(tl.float32), input_precision=DOT_PRECISION)
