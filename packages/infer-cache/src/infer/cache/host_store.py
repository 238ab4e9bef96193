"""HostKVStore: KV blocks in host memory, where the prefix tree keeps what the device pool evicts.

A slot holds one block of the pool, every layer's K and V (and an fp8 pool's scale bytes), bit
for bit, as bytes: `[num_slots, bytes_per_block]`, one slot contiguous, so moving a block is one
copy whatever the layer count. On a CPU pool the "host" is the same memory and the copies are
plain ones: what the CPU tests run, on a pool small enough to evict.

With a CUDA pool the memory is pinned and the copies over the bus run on two streams of the
store's own, one a direction, so that they overlap the steps' forwards (and each other) instead
of queueing in front of them. What stays on the step's stream is what the step must see done:
  offload  the step's stream gathers the blocks into a device staging buffer (a device copy, fast)
           and goes on; the buffer goes down to the slots on the offload stream. The blocks' next
           owners write them in the step's forward, after the gather read them.
  restore  the restore stream brings the slots up into a staging buffer as soon as the step is
           launched (with async scheduling, while the step before it still runs); the step's
           stream waits for that copy alone, then scatters the buffer into the blocks, before the
           forward that reads them.
Staging buffers are a ring of STAGING_BUFFERS a direction, each reused once its last copy is
done (the step's stream waits on that only when more than a ring's worth of blocks is in
flight). A slot is copied in the order of the operations: an offload into a slot that a restore
still reads waits for it, and a restore of a slot waits for the offload that wrote it.
"""

from dataclasses import dataclass

import torch

from infer.cache.block_allocator import BlockAllocator
from infer.cache.shape import KVCacheShape

# Bytes of one staging buffer: 32 blocks of llama-3.1-8b's 2 MiB (16 tokens); copies of that size
# run at the bus's speed. With STAGING_BUFFERS of them a direction, 256 MiB of device memory each
# way is in flight at most before the step's stream waits for the oldest copy.
STAGING_BUFFER_BYTES = 64 * 2**20
STAGING_BUFFERS = 4


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
        # Blocks a staging buffer holds: no more than the store (a small pool's buffers stay small).
        self.staged_blocks = min(num_slots, max(1, STAGING_BUFFER_BYTES // shape.bytes_per_block()))
        self._streams: _CopyStreams | None = None  # made on the first copy from a CUDA pool

    @staticmethod
    def bytes_per_slot(shape: KVCacheShape) -> int:
        return shape.bytes_per_block()

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def offload(self, layer_tensors, blocks: list[int], slots: list[int]) -> None:
        """Copies the pool's `blocks` into `slots` (layer_tensors: PagedKVPool.layer_tensors, the
        pool's (k, v) per layer and an fp8 pool's scales)."""
        n = self.staged_blocks
        for at in range(0, len(blocks), n):
            self._offload(layer_tensors, blocks[at : at + n], slots[at : at + n])

    def restore(self, layer_tensors, slots: list[int], blocks: list[int]) -> None:
        """Writes `slots` over the pool's `blocks`."""
        n = self.staged_blocks
        for at in range(0, len(blocks), n):
            self._restore(layer_tensors, slots[at : at + n], blocks[at : at + n])

    def copy_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The (offload, restore) streams the copies of a CUDA pool on `device` run on."""
        streams = self._copy_streams(device)
        return streams.offload, streams.restore

    def synchronize(self) -> None:
        """Waits for every copy into or out of the slots (for a reader of `slots` on the host)."""
        if self._streams is not None:
            for stream in (self._streams.offload, self._streams.restore):
                stream.synchronize()

    def _offload(self, layer_tensors, blocks: list[int], slots: list[int]) -> None:
        device = layer_tensors[0][0].device
        block_ids = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
        parts = [t.view(torch.uint8)[block_ids].flatten(1) for layer in layer_tensors for t in layer]
        if device.type != "cuda":
            staged = torch.cat(parts, 1)
            for start, end, first in _runs(slots):
                self.slots[first : first + end - start].copy_(staged[start:end])
            return
        streams = self._copy_streams(device)
        step = torch.cuda.current_stream(device)
        buffer = streams.next_buffer(streams.offload_ring)
        buffer.wait_free(step)
        staged = buffer.tensor[: len(blocks)]
        torch.cat(parts, 1, out=staged)
        gathered = step.record_event()
        streams.offload.wait_event(gathered)
        streams.wait_slots(streams.offload, slots)
        with torch.cuda.stream(streams.offload):
            for start, end, first in _runs(slots):
                self.slots[first : first + end - start].copy_(staged[start:end], non_blocking=True)
        done = streams.offload.record_event()
        buffer.free_after = done
        streams.mark_slots(slots, done)

    def _restore(self, layer_tensors, slots: list[int], blocks: list[int]) -> None:
        device = layer_tensors[0][0].device
        block_ids = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
        if device.type != "cuda":
            staged = self.slots[slots]  # a copy of those rows
            _scatter(layer_tensors, staged, block_ids)
            return
        streams = self._copy_streams(device)
        step = torch.cuda.current_stream(device)
        buffer = streams.next_buffer(streams.restore_ring)
        buffer.wait_free(streams.restore)
        streams.wait_slots(streams.restore, slots)
        staged = buffer.tensor[: len(slots)]
        with torch.cuda.stream(streams.restore):
            for start, end, first in _runs(slots):
                staged[start:end].copy_(self.slots[first : first + end - start], non_blocking=True)
        loaded = streams.restore.record_event()
        streams.mark_slots(slots, loaded)
        step.wait_event(loaded)
        _scatter(layer_tensors, staged, block_ids)
        buffer.free_after = step.record_event()

    def _copy_streams(self, device: torch.device) -> "_CopyStreams":
        if self._streams is None:
            self._streams = _CopyStreams(device, self.staged_blocks, self.slots.shape[1])
        return self._streams


def _scatter(layer_tensors, staged: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Writes the staged blocks' bytes into each layer tensor's `block_ids`."""
    # As bytes (a view of the same memory): index_copy_ has no fp8 kernels.
    tensors = [t.view(torch.uint8) for layer in layer_tensors for t in layer]
    sizes = [t[0].numel() for t in tensors]
    for t, part in zip(tensors, staged.split(sizes, 1), strict=True):
        t.index_copy_(0, block_ids, part.reshape(len(block_ids), *t.shape[1:]))


@dataclass
class _StagingBuffer:
    tensor: torch.Tensor
    free_after: torch.cuda.Event | None = None  # the end of the last copy that used it

    def wait_free(self, stream: torch.cuda.Stream) -> None:
        if self.free_after is not None:
            stream.wait_event(self.free_after)


class _CopyStreams:
    """A CUDA pool's copy streams, staging rings, and the last copy of each slot in flight."""

    def __init__(self, device: torch.device, staged_blocks: int, bytes_per_block: int):
        self.offload = torch.cuda.Stream(device)
        self.restore = torch.cuda.Stream(device)

        def ring() -> list[_StagingBuffer]:
            shape = (staged_blocks, bytes_per_block)
            return [_StagingBuffer(torch.empty(shape, dtype=torch.uint8, device=device))
                    for _ in range(STAGING_BUFFERS)]  # fmt: skip

        self.offload_ring, self.restore_ring = ring(), ring()
        self._turns = {id(self.offload_ring): 0, id(self.restore_ring): 0}
        self._slot_copies: dict[int, torch.cuda.Event] = {}
        self._prune_above = 1024  # entries before the next sweep of finished copies

    def next_buffer(self, ring: list[_StagingBuffer]) -> _StagingBuffer:
        turn = self._turns[id(ring)]
        self._turns[id(ring)] = turn + 1
        return ring[turn % len(ring)]

    def wait_slots(self, stream: torch.cuda.Stream, slots: list[int]) -> None:
        """`stream` waits for the copies in flight that last read or wrote these slots."""
        events = {id(event): event for slot in slots if (event := self._slot_copies.get(slot)) is not None}
        for event in events.values():
            stream.wait_event(event)

    def mark_slots(self, slots: list[int], event: torch.cuda.Event) -> None:
        for slot in slots:
            self._slot_copies[slot] = event
        if len(self._slot_copies) > self._prune_above:
            # Forget the copies that are done; sweeping again only after the map doubles keeps
            # the queries a constant number a slot, however many slots stay in flight.
            done = {id(e): e.query() for e in self._slot_copies.values()}
            self._slot_copies = {s: e for s, e in self._slot_copies.items() if not done[id(e)]}
            self._prune_above = max(1024, 2 * len(self._slot_copies))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, first slot) of each stretch of `slots` that counts up by one: one copy each."""
    runs = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs
