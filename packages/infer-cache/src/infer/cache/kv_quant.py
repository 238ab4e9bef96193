"""Int8 storage for cold prefix-cache blocks: symmetric quantization in groups along head_dim.

A group is `group_size` consecutive elements of one token's K (or V) vector of one head; it is
stored as int8 values q and one float32 scale s = max|x| / 127, and read back as q * s. Rounding
moves each element by at most s / 2 = max|x| / 254 (0.4% of the group's largest magnitude); the
bf16 or fp16 the block is restored in adds its own rounding (at most 0.4% of the element), so a
restored element is within 1% of its group's max of the original. The float32 scale keeps that
bound for groups of any magnitude (a bf16 scale would add its own 0.4%).

A block of int8 K and V with one float32 scale per 64 elements takes (64 + 4) / 128 = 53% of the
bytes of the same block in bf16. The second design document (section 13) quantizes whole cached
conversations of 256 tokens or more in groups of 64; here the unit is a KV block of the prefix
tree, quantized when it goes cold (see PrefixTree).
"""

import math

import torch

from infer.cache.block_allocator import BlockAllocator
from infer.cache.shape import KVCacheShape

GROUP_SIZE = 64
QMAX = 127


def group_size_for(head_dim: int) -> int:
    """GROUP_SIZE, or the largest divisor of head_dim that divides it (small test models)."""
    return math.gcd(GROUP_SIZE, head_dim)


def quantize_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values shaped as x, float32 scales shaped [..., x.shape[-1] // group_size])."""
    groups = x.float().unflatten(-1, (-1, group_size))
    scales = groups.abs().amax(-1) / QMAX
    # An all-zero group keeps scale 0 and quantizes to zeros (dividing by 1 instead of 0).
    q = torch.round(groups / torch.where(scales == 0, 1.0, scales).unsqueeze(-1))
    return q.clamp_(-QMAX, QMAX).to(torch.int8).flatten(-2), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_int8, in `dtype`."""
    groups = q.float().unflatten(-1, (scales.shape[-1], -1))
    return (groups * scales.unsqueeze(-1)).flatten(-2).to(dtype)


class QuantizedKVStore:
    """`num_slots` int8 blocks of a pool's shape, each with its scales; `allocator` lends slots.

    Layout per layer: `(k, k_scales, v, v_scales)`, int8 `[num_slots, block_size, num_kv_heads,
    head_dim]` and float32 `[num_slots, block_size, num_kv_heads, head_dim // group_size]`, on
    `device`: the pool's (a share of its memory), or the host's with `on_host` (the host tier in
    int8: blocks are quantized on the pool's device and then copied down, and back up before
    they are dequantized)."""

    def __init__(
        self,
        shape: KVCacheShape,
        num_slots: int,
        device: torch.device | str = "cpu",
        *,
        on_host: bool = False,
        pin_memory: bool = False,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if shape.is_fp8:
            raise ValueError("an fp8 pool's blocks are 1 byte an element already; int8 would not shrink them")
        self.shape = shape
        self.num_slots = num_slots
        self.on_host = on_host
        self.group_size = group_size_for(shape.head_dim)
        self.allocator = BlockAllocator(num_slots)
        dims = (num_slots, shape.block_size, shape.num_kv_heads, shape.head_dim)
        scale_dims = (*dims[:-1], shape.head_dim // self.group_size)
        self.layers = [
            tuple(
                torch.zeros(d, dtype=t, device=device, pin_memory=pin_memory)
                for d, t in ((dims, torch.int8), (scale_dims, torch.float32)) * 2
            )
            for _ in range(shape.num_layers)
        ]

    @staticmethod
    def bytes_per_slot(shape: KVCacheShape) -> int:
        elements = 2 * shape.num_layers * shape.block_size * shape.num_kv_heads * shape.head_dim
        return elements + 4 * elements // group_size_for(shape.head_dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    def offload(self, kv_layers, blocks: list[int], slots: list[int]) -> None:
        """Stores the pool's `blocks` (kv_layers: the pool's (k, v) per layer) into `slots`."""
        pool_device, device = kv_layers[0][0].device, self.layers[0][0].device
        block_ids = torch.tensor(blocks, dtype=torch.long).to(pool_device, non_blocking=True)
        slot_ids = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        for (k_cache, v_cache), (k, k_scales, v, v_scales) in zip(kv_layers, self.layers, strict=True):
            for cache, values, scales in ((k_cache, k, k_scales), (v_cache, v, v_scales)):
                q, s = quantize_int8(cache.index_select(0, block_ids), self.group_size)
                values.index_copy_(0, slot_ids, q.to(device))
                scales.index_copy_(0, slot_ids, s.to(device))

    def restore(self, kv_layers, slots: list[int], blocks: list[int]) -> None:
        """Writes `slots`, dequantized, over the pool's `blocks`."""
        pool_device, device = kv_layers[0][0].device, self.layers[0][0].device
        block_ids = torch.tensor(blocks, dtype=torch.long).to(pool_device, non_blocking=True)
        slot_ids = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        for (k_cache, v_cache), (k, k_scales, v, v_scales) in zip(kv_layers, self.layers, strict=True):
            for cache, values, scales in ((k_cache, k, k_scales), (v_cache, v, v_scales)):
                restored = dequantize_int8(
                    values.index_select(0, slot_ids).to(pool_device, non_blocking=True),
                    scales.index_select(0, slot_ids).to(pool_device, non_blocking=True),
                    cache.dtype,
                )
                cache.index_copy_(0, block_ids, restored)
