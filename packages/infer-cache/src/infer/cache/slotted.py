"""A pool of fixed-length KV slots for continuous batching (`kv_cache_backend="slotted"`).

Same per-layer layout as ContiguousKVCache, `[num_slots, num_kv_heads, max_seq_len, head_dim]`,
but slots are handed to requests and taken back as they arrive and finish, so row b of a batch
uses whatever slot its request holds (ForwardBatch.slot_ids). Each slot reserves max_seq_len
tokens whether the request uses them or not; the paged pool removes that waste later.
"""

from collections.abc import Collection

import torch

from infer.cache.allocator import SlotAllocator
from infer.cache.contiguous import ContiguousKVCache, KVCacheShape


class SlottedKVCache:
    """`num_slots` sequences' worth of K and V, allocated once, lent out one slot per request."""

    def __init__(self, shape: KVCacheShape, *, num_slots: int, device: torch.device | str = "cpu"):
        # The tensors are exactly a ContiguousKVCache's; only the lending is new here.
        self._storage = ContiguousKVCache(shape, num_slots=num_slots, device=device)
        self._slots = SlotAllocator(num_slots)
        self.shape = shape
        self.num_slots = num_slots

    @property
    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._storage.kv_layers

    @property
    def kv_bytes(self) -> int:
        return self._storage.kv_bytes

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    @property
    def usage_ratio(self) -> float:
        """Fraction of slots lent out (0.0 empty, 1.0 full), the engine's KV usage metric."""
        return self._slots.usage_ratio

    def allocate(self, owner: str) -> int:
        """A free slot for request `owner`. Raises CacheFullError when every slot is lent out.

        The slot's old contents are not cleared: attention reads a slot only up to positions the
        new request has written (ForwardBatch: visibility is by position).
        """
        return self._slots.allocate(owner)

    def free(self, slot: int) -> None:
        """Takes `slot` back. DoubleFreeError if it is free, ForeignBlockError if out of range."""
        self._slots.free(slot)

    def owner_of(self, slot: int) -> str | None:
        return self._slots.owner_of(slot)

    def audit(self, live_owners: Collection[str]) -> list[int]:
        """Slots still held by requests not in `live_owners` (leaks), sorted; changes nothing."""
        return self._slots.audit(live_owners)
