"""HostKVStore: KV blocks in host memory, where the prefix tree keeps what the device pool evicts.

A slot holds one block of the pool, every layer's K and V (and an fp8 pool's scale bytes), bit
for bit, as bytes: `[num_slots, bytes_per_block]`, one slot contiguous, so moving a block is one
copy whatever the layer count. With a CUDA pool the memory is pinned, and both
directions are queued on the device's stream without waiting for it (pinned memory is what lets a
device-to-host copy return before it lands): an offload gathers the blocks on the device and
copies each slot down; a restore copies the slots up and scatters them into the blocks. The
stream orders them with the steps around them, so an offloaded block's next owner writes it only
after the copy read it, and a restored block is read only after it landed; a slot freed by a
restore and taken by a later offload is written after the restore read it, for the same reason.
On a CPU pool the "host" is the same memory, and the copies are plain ones: what the CPU tests
run, on a pool small enough to evict.
"""

import torch

from infer.cache.block_allocator import BlockAllocator
from infer.cache.shape import KVCacheShape

# Blocks moved through one device buffer at a time: 128 MiB of it for llama-3.1-8b's 2 MiB
# blocks of 16 tokens, whatever number the tree evicts at once.
STAGED_BLOCKS = 64


class HostKVStore:
    """`num_slots` blocks of a pool's shape in host memory; `allocator` lends slots."""

    # Where the blocks live: what the engine's counters call them (infer.engine's host tier).
    on_host = True

    def __init__(self, shape: KVCacheShape, num_slots: int, *, pin_memory: bool = False):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.shape = shape
        self.num_slots = num_slots
        self.allocator = BlockAllocator(num_slots)
        self.slots = torch.empty(
            (num_slots, shape.bytes_per_block()), dtype=torch.uint8, pin_memory=pin_memory
        )

    @staticmethod
    def bytes_per_slot(shape: KVCacheShape) -> int:
        return shape.bytes_per_block()

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def offload(self, layer_tensors, blocks: list[int], slots: list[int]) -> None:
        """Copies the pool's `blocks` into `slots` (layer_tensors: PagedKVPool.layer_tensors, the
        pool's (k, v) per layer and an fp8 pool's scales)."""
        for at in range(0, len(blocks), STAGED_BLOCKS):
            self._offload(layer_tensors, blocks[at : at + STAGED_BLOCKS], slots[at : at + STAGED_BLOCKS])

    def restore(self, layer_tensors, slots: list[int], blocks: list[int]) -> None:
        """Writes `slots` over the pool's `blocks`."""
        for at in range(0, len(blocks), STAGED_BLOCKS):
            self._restore(layer_tensors, slots[at : at + STAGED_BLOCKS], blocks[at : at + STAGED_BLOCKS])

    def _offload(self, layer_tensors, blocks: list[int], slots: list[int]) -> None:
        block_ids = torch.tensor(blocks, dtype=torch.long).to(layer_tensors[0][0].device, non_blocking=True)
        # [n, bytes_per_block] on the device: one copy a run of slots.
        staged = torch.cat(
            [t.view(torch.uint8)[block_ids].flatten(1) for layer in layer_tensors for t in layer], 1
        )
        for start, end, first in _runs(slots):
            self.slots[first : first + end - start].copy_(staged[start:end], non_blocking=True)

    def _restore(self, layer_tensors, slots: list[int], blocks: list[int]) -> None:
        device = layer_tensors[0][0].device
        staged = torch.empty((len(slots), self.slots.shape[1]), dtype=self.slots.dtype, device=device)
        for start, end, first in _runs(slots):
            staged[start:end].copy_(self.slots[first : first + end - start], non_blocking=True)
        block_ids = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
        # As bytes (a view of the same memory): index_copy_ has no fp8 kernels.
        tensors = [t.view(torch.uint8) for layer in layer_tensors for t in layer]
        sizes = [t[0].numel() for t in tensors]
        for t, part in zip(tensors, staged.split(sizes, 1), strict=True):
            t.index_copy_(0, block_ids, part.view(len(blocks), *t.shape[1:]))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, first slot) of each stretch of `slots` that counts up by one: one copy each."""
    runs = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs
