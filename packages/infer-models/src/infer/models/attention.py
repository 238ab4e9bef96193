"""Scaled dot-product attention over this step's keys, or over a slotted KV cache.

With a cache, this step's k and v are first written into the cache at (slot, position); the
queries then read each row's slot up to `context_len`. Visibility is decided by positions alone:
key position j is visible from a query at position p when j <= p (and p - j < window for a
sliding-window layer). See ForwardBatch for the padding rule that makes this sufficient.

Kernels, chosen by shape and device, because the key length changes every decode step:
- one query per row (decode) over a cache on CUDA: `infer.kernels.decode_attention`, which reads
  each row's own keys straight from its slot (no gather to the longest row's length). Its lengths
  live on the device, so CUDA graphs replay it for any lengths.
- one query per row otherwise: grouped matmuls, `_grouped_decode_attention`. PyTorch's SDPA with a
  mask and GQA either falls to its math path or picks cuDNN, which builds a new plan for every
  new key length: about 50 ms a call, measured on an H100 (docs/benchmarks/serving.md).
- several queries per row (prefill): SDPA's memory-efficient kernel (which takes a mask but not
  GQA, so K/V heads are repeated) with cuDNN left out for the same reason.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from infer.kernels import decode_attention
from infer.models.forward_batch import ForwardBatch

# Every SDPA backend but cuDNN, whose per-shape planning costs more than the attention itself.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    layer_idx: int,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]. Returns [B, T, Hq, D]."""
    if batch.kv_layers is not None and q.shape[1] == 1 and q.is_cuda:
        return _decode_from_cache(q, k, v, batch, layer_idx, scale=scale, sliding_window=sliding_window)
    if batch.kv_layers is None:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)
        key_positions = batch.positions
    else:
        keys, values = _write_and_read_cache(k, v, batch, layer_idx)
        key_positions = torch.arange(keys.shape[2], device=q.device).expand(q.shape[0], -1)
    query_positions = batch.positions
    visible = key_positions[:, None, :] <= query_positions[:, :, None]
    if sliding_window is not None:
        visible &= key_positions[:, None, :] > query_positions[:, :, None] - sliding_window
    if q.shape[1] == 1:
        return _grouped_decode_attention(q, keys, values, visible, scale)
    group_size = q.shape[2] // keys.shape[1]
    if group_size > 1:
        keys, values = keys.repeat_interleave(group_size, 1), values.repeat_interleave(group_size, 1)
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=visible[:, None, :, :], scale=scale
        )
    return out.transpose(1, 2)


def _grouped_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [B, 1, Hq, D]; keys, values: [B, Hkv, S, D]; visible: [B, 1, S]. Returns [B, 1, Hq, D].

    The Hq / Hkv query heads that share a KV head are one matmul against it; softmax in fp32."""
    batch_size, _, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped_q = q.reshape(batch_size, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped_q, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~visible[:, None, :, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(batch_size, 1, num_q_heads, head_dim)


def _decode_from_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    layer_idx: int,
    *,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    k_cache, v_cache = batch.kv_layers[layer_idx]
    slot_ids = _write_cache(k, v, batch, layer_idx)
    seq_lens = batch.seq_lens
    if seq_lens is None:
        seq_lens = (batch.positions[:, 0] + 1).clamp(max=k_cache.shape[2])
    out = decode_attention(
        q[:, 0], k_cache, v_cache, slot_ids, seq_lens, scale=scale, sliding_window=sliding_window
    )
    return out[:, None]


def _write_cache(k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer_idx: int) -> torch.Tensor:
    """Writes this step's k and v at (slot, position); returns the [B] slot of each row."""
    k_cache, v_cache = batch.kv_layers[layer_idx]
    positions = batch.positions.clamp(max=k_cache.shape[2] - 1)
    slot_ids = batch.slot_ids
    if slot_ids is None:
        slot_ids = torch.arange(k.shape[0], device=k.device)
    slots = slot_ids[:, None].expand_as(positions)
    # Advanced indices around a slice: the indexed view is [B, T, Hkv, D], as k is.
    k_cache[slots, :, positions] = k
    v_cache[slots, :, positions] = v
    return slot_ids


def _write_and_read_cache(
    k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _write_cache(k, v, batch, layer_idx)
    k_cache, v_cache = batch.kv_layers[layer_idx]
    context_len = batch.context_len or k_cache.shape[2]
    if batch.slot_ids is None:
        return k_cache[: k.shape[0], :, :context_len], v_cache[: k.shape[0], :, :context_len]
    return k_cache[batch.slot_ids, :, :context_len], v_cache[batch.slot_ids, :, :context_len]
