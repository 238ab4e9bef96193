"""Attention of a flat batch: write this step's K/V into the cache, then read it through block tables.

With a cache (the engine): each new token's k and v are written at its slot, and
`paged_attention` serves every row from the cache, one-token decode rows and multi-token extend
rows (a prompt chunk attending to its cached prefix and itself) alike. There is one path whatever
the pool (paged, or contiguous, which is paged with one block per sequence) and whatever the step
holds; the kernel, not this module, splits decode rows from extend rows.

One writer of the KV cache per backend:
- CUDA: the layer's rotation kernel (`rope` or `qk_norm_rope` with `store=`) writes k and v on
  its way out (`kv_store` says where; one kernel fewer per layer), and `attention` is called
  with `kv_stored=True`; but an fp8 cache (`ForwardBatch.kv_scales`) is written by `store_kv`,
  which quantizes (infer.kernels.kv_fp8);
- a CPU, through PyTorch: `store_kv`, here (`kv_store` gives None there: the CPU rotation takes
  rows gathered once a forward, and a store is an op of its own either way);
- a CPU decode step on the C decoder stack (infer.models.cpu_stack, chosen by the engine's
  runner): the C stack, which runs every block itself.

Without a cache (oracles, tests): each row attends causally to its own tokens in this batch, by
position, with SDPA; the tokens of one image (`ForwardBatch.image_groups`) attend to each other
both ways, as Gemma 3's do. With a cache, `AttentionMetadata.lookahead` does that (the engine
computes an image's tokens in one forward).
"""

import torch
import torch.nn.functional as F

from infer.kernels import KVStore, paged_attention, store_kv
from infer.models.forward_batch import ForwardBatch


def kv_store(v: torch.Tensor, batch: ForwardBatch, layer_idx: int) -> KVStore | None:
    """Where this layer's new keys and `v` go in the cache, for the op that writes the rotated
    keys; None without a cache, and on a CPU, where the store is an op of its own either way
    (`attention` then calls `store_kv`), and for an fp8 cache, which `store_kv` quantizes."""
    if batch.kv_layers is None or v.device.type == "cpu" or batch.kv_scales is not None:
        return None
    k_cache, v_cache = batch.kv_layers[layer_idx]
    return KVStore(v, k_cache, v_cache, batch.attention.slot_mapping)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    layer_idx: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    kv_stored: bool = False,
    native_cpu_kernels: bool = True,
    pdl: bool = False,
) -> torch.Tensor:
    """q: [N, Hq, D]; k, v: [N, Hkv, D]. Returns [N, Hq, D]. `kv_stored`: k and v are already in
    the cache (written where `kv_store` said). `native_cpu_kernels`, `pdl`: paged_attention's
    `native` and `pdl` launch options."""
    if batch.kv_layers is None:
        return _attention_without_cache(q, k, v, batch, scale=scale, sliding_window=sliding_window)
    if batch.image_groups is not None:
        raise ValueError(
            "image_groups are for a cache-less forward; with a cache, AttentionMetadata.lookahead "
            "lets an image's tokens see each other"
        )
    metadata = batch.attention
    k_cache, v_cache = batch.kv_layers[layer_idx]
    k_scales, v_scales = batch.kv_scales[layer_idx] if batch.kv_scales is not None else (None, None)
    if not kv_stored:
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scales=k_scales, v_scales=v_scales)
    return paged_attention(
        q,
        k_cache,
        v_cache,
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
        block_tables=metadata.block_tables,
        num_decode_rows=metadata.num_decode_rows,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        scale=scale,
        sliding_window=sliding_window,
        extend_tiles=metadata.extend_tiles,
        decode_key_slots=metadata.decode_key_slots,
        lookahead=metadata.lookahead,
        native=native_cpu_kernels,
        pdl=pdl,
        k_scales=k_scales,
        v_scales=v_scales,
    )


def _attention_without_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    *,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    outputs = []
    groups = batch.rows(batch.image_groups) if batch.image_groups is not None else [None] * len(batch.rows(q))
    for q_row, k_row, v_row, positions, group in zip(
        batch.rows(q), batch.rows(k), batch.rows(v), batch.rows(batch.positions), groups, strict=True
    ):
        visible = positions[None, :] <= positions[:, None]
        if sliding_window is not None:
            visible &= positions[None, :] > positions[:, None] - sliding_window
        if group is not None:  # an image's tokens see each other, later ones too (Gemma 3)
            visible |= (group[None, :] == group[:, None]) & (group[:, None] >= 0)
        out = F.scaled_dot_product_attention(
            q_row.transpose(0, 1),
            k_row.transpose(0, 1),
            v_row.transpose(0, 1),
            attn_mask=visible,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
