"""Attention of one new query per sequence over that sequence's keys in a slotted KV cache.

The decode step of a batch: row b's query (all heads) attends to keys 0..seq_lens[b]-1 of cache
slot slot_ids[b] (and, with a sliding window, only the last `sliding_window` of them). The cache
is `[num_slots, num_kv_heads, max_len, head_dim]`, the layout of infer.cache's slotted pool.

Gathering each row's slot into a padded `[batch, kv_heads, longest, head_dim]` tensor and running
matmuls over it (the reference below) copies every row's keys and values to the length of the
longest row, then reads them again. The Triton kernel reads each row's own keys and values once,
straight from its slot, with an online softmax (flash-decoding without the split): one program
per (row, KV head) serves the query heads of that KV head's group together. Scores,
probabilities and the accumulator stay in fp32. Lengths are read on
the device, so a CUDA graph can replay it for any lengths.
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton

_NUM_WARPS = 4
# tl.dot needs every dim to be at least 16: the query heads of a group (2-8) are padded to it.
_MIN_DOT = 16


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    slot_ptr,
    seq_len_ptr,
    q_stride_row,
    q_stride_head,
    k_stride_slot,
    k_stride_head,
    k_stride_pos,
    v_stride_slot,
    v_stride_head,
    v_stride_pos,
    out_stride_row,
    out_stride_head,
    scale,
    sliding_window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_len_ptr + row).to(tl.int32)

    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    head_mask = heads < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    q = tl.load(
        q_ptr + row * q_stride_row + q_heads[:, None] * q_stride_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - sliding_window, 0)
    # Blocks start at multiples of BLOCK_N; every block the loop visits holds a visible key, so
    # the running maximum is finite from the first block on.
    start = (first // BLOCK_N) * BLOCK_N
    k_base = k_ptr + slot * k_stride_slot + kv_head * k_stride_head
    v_base = v_ptr + slot * v_stride_slot + kv_head * v_stride_head

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denominator = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for block_start in range(start, seq_len, BLOCK_N):
        keys_at = block_start + tl.arange(0, BLOCK_N)
        visible = (keys_at < seq_len) & (keys_at >= first)
        load_mask = visible[:, None] & dim_mask[None, :]
        k = tl.load(k_base + keys_at[:, None] * k_stride_pos + dims[None, :], mask=load_mask, other=0.0)
        v = tl.load(v_base + keys_at[:, None] * v_stride_pos + dims[None, :], mask=load_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        scores = tl.where(visible[None, :], scores * scale, float("-inf"))
        block_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - block_max)
        probs = tl.exp(scores - block_max[:, None])
        denominator = denominator * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs, v.to(tl.float32), input_precision=DOT_PRECISION)
        running_max = block_max

    out = acc / denominator[:, None]
    tl.store(
        out_ptr + row * out_stride_row + q_heads[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dim_mask[None, :],
    )


def _launch(q, k_cache, v_cache, slot_ids, seq_lens, scale, sliding_window) -> torch.Tensor:
    batch_size, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if batch_size:
        _decode_attention_kernel[(batch_size, num_kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            slot_ids.contiguous(),
            seq_lens.contiguous(),
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            out.stride(0),
            out.stride(1),
            scale,
            sliding_window or 0,
            GROUP=group,
            GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            BLOCK_N=64 if dim_pad <= 128 else 32,
            HAS_WINDOW=sliding_window is not None,
            # tf32 holds bf16 and fp16 inputs exactly (10 mantissa bits) and runs on tensor
            # cores; fp32 inputs get full-precision dots.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=_NUM_WARPS,
        )
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The reference: gather each row's slot up to the longest row, masked softmax in fp32."""
    batch_size, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    longest = int(seq_lens.max()) if batch_size else 0
    keys = k_cache[slot_ids, :, :longest].float()  # [B, Hkv, S, D]
    values = v_cache[slot_ids, :, :longest].float()
    grouped_q = q.float().reshape(batch_size, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped_q, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    key_positions = torch.arange(longest, device=q.device)
    visible = key_positions[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        visible &= key_positions[None, :] >= seq_lens[:, None] - sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), values)
    return out.reshape(batch_size, num_q_heads, head_dim).to(q.dtype)


def _check(q, k_cache, v_cache, slot_ids, seq_lens, sliding_window) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, slot_ids=slot_ids, seq_lens=seq_lens)
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [batch, q_heads, head_dim] and k_cache [slots, kv_heads, max_len, head_dim], "
            f"got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must match each other and q's dtype: {tuple(k_cache.shape)} "
            f"{k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}, q {q.dtype}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(
            f"q's head_dim must equal the cache's and its heads be a multiple of the KV heads: "
            f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")
    for name, t in (("slot_ids", slot_ids), ("seq_lens", seq_lens)):
        if t.shape != (q.shape[0],) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be an int32/int64 tensor of shape ({q.shape[0]},), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] against keys/values 0..seq_lens[b]-1 of slot slot_ids[b] in the caches
    [slots, Hkv, max_len, D]; with `sliding_window`, only the last that many. Returns [B, Hq, D].

    The caller keeps 1 <= seq_lens[b] <= max_len and slot ids in range: they are read on the
    device (no host sync), so they are not checked.
    """
    _check(q, k_cache, v_cache, slot_ids, seq_lens, sliding_window)
    if use_triton(q):
        return _launch(q, k_cache, v_cache, slot_ids, seq_lens, scale, sliding_window)
    return decode_attention_ref(
        q, k_cache, v_cache, slot_ids, seq_lens, scale=scale, sliding_window=sliding_window
    )
