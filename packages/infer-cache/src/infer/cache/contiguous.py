"""Pre-allocated per-layer K and V for a fixed number of sequences (`kv_cache_backend="contiguous"`).

Layout per layer: `[num_slots, num_kv_heads, max_seq_len, head_dim]`, the layout that
`infer.models.ForwardBatch.kv_layers` expects. Row b of a batch uses slot b.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        # K and V, for every layer and KV head.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def kv_bytes(self, num_tokens: int) -> int:
        return self.bytes_per_token() * num_tokens


class ContiguousKVCache:
    """One contiguous K and V tensor per layer, allocated once, never resized."""

    def __init__(self, shape: KVCacheShape, *, num_slots: int = 1, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if shape.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {shape.max_seq_len}")
        self.shape = shape
        self.num_slots = num_slots
        dims = (num_slots, shape.num_kv_heads, shape.max_seq_len, shape.head_dim)
        self.kv_layers = [
            (
                torch.zeros(dims, dtype=shape.dtype, device=device),
                torch.zeros(dims, dtype=shape.dtype, device=device),
            )
            for _ in range(shape.num_layers)
        ]

    @property
    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_layers)
