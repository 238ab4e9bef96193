"""PagedKVPool: per-layer K and V tensors cut into blocks, lent out by a BlockAllocator.

Layout per layer, `(k_cache, v_cache)`, each `[num_blocks + 1, block_size, num_kv_heads,
head_dim]`, zero-initialised: the layout `infer.models.ForwardBatch.kv_layers` documents. They are
views of one tensor that holds every layer's (see `__init__`). Token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`.

An fp8 pool (`shape.dtype` float8_e4m3fn, infer.kernels.kv_fp8) holds besides, per layer,
`kv_scales`: `(k_scales, v_scales)`, uint8 `[num_blocks + 1, block_size, num_kv_heads]`, each
vector's scale byte. A block's scales move with its values: `layer_tensors` names both, and
every block operation moves what it names.

The last block, `null_block` (= num_blocks), is reserved: the allocator lends only
0..num_blocks-1, so no request ever owns it. Padding rows of a CUDA graph write their keys there
(slot_mapping points at it), which keeps every real block clean without a branch in the kernel.

With a `store`, the pool has a second tier where the prefix tree keeps blocks it evicts: a
QuantizedKVStore (kv_quant.py: int8, in a share of the device's memory or in the host's) or a
HostKVStore (host_store.py: the pool's dtype in host memory). `run_block_ops` moves K/V between
the pool and its store, and copies blocks.

The "contiguous" (slotted) cache is not a separate class: it is
`PagedKVPool(KVCacheShape(..., block_size=max_seq_len), num_blocks=max_batch_size)`, one block
per sequence.
"""

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch

from infer.cache.block_allocator import BlockAllocator
from infer.cache.host_store import HostKVStore
from infer.cache.kv_quant import QuantizedKVStore
from infer.cache.shape import KVCacheShape


class BlockOpKind(enum.StrEnum):
    """What a block operation does (a str: it compares and prints as its value)."""

    COPY = "copy"  # block -> block: copy-on-write of the block a prefix match ends inside
    OFFLOAD = "offload"  # block -> slot: a block the tree evicts, into the pool's store
    RESTORE = "restore"  # slot -> block: a stored block back into the pool


COPY, OFFLOAD, RESTORE = BlockOpKind.COPY, BlockOpKind.OFFLOAD, BlockOpKind.RESTORE


class BlockOp(NamedTuple):
    """One of the block operations a step may need before its forward (ScheduleDecision's)."""

    kind: BlockOpKind
    source: int  # a block (COPY, OFFLOAD) or a slot of the store (RESTORE)
    target: int  # a block (COPY, RESTORE) or a slot of the store (OFFLOAD)


class PagedKVPool:
    """`num_blocks` lendable blocks of `shape.block_size` tokens, plus the reserved null block."""

    def __init__(
        self,
        shape: KVCacheShape,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        store: QuantizedKVStore | HostKVStore | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks must be >= 1, got {num_blocks}; size it with num_blocks_for_memory()"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        dims = (num_blocks + 1, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Every layer's K and V are views of one tensor (layer i's K is [2i], its V [2i + 1]), and
        # an fp8 pool's scales of another, so that copying blocks in every layer is one gather and
        # one scatter: with two launches per layer and tensor, copying one block of Llama 3.2 1B's
        # 16 layers took 584 us of host time on an H200, 65 us at once
        # (docs/benchmarks/serving.md#host-time-a-step).
        num_tensors = 2 * shape.num_layers
        self._stacked_layers = [torch.zeros((num_tensors, *dims), dtype=shape.dtype, device=device)]
        kv = self._stacked_layers[0]
        self.kv_layers = [(kv[2 * i], kv[2 * i + 1]) for i in range(shape.num_layers)]
        self.kv_scales = None
        if shape.is_fp8:
            scales = torch.zeros((num_tensors, *dims[:3]), dtype=torch.uint8, device=device)
            self._stacked_layers.append(scales)
            self.kv_scales = [(scales[2 * i], scales[2 * i + 1]) for i in range(shape.num_layers)]
        # Bytes of every K and V tensor (and fp8 scales), the null block included.
        self.kv_bytes = sum(t.numel() * t.element_size() for t in self._stacked_layers)
        if store is not None and store.shape != shape:
            raise ValueError(f"the store's blocks are {store.shape}, the pool's {shape}")
        self.store = store

    @property
    def layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, every tensor that holds its blocks (block first): (k, v), and an fp8 pool's
        (k_scales, v_scales) after them."""
        if self.kv_scales is None:
            return list(self.kv_layers)
        return [(*kv, *scales) for kv, scales in zip(self.kv_layers, self.kv_scales, strict=True)]

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def null_block(self) -> int:
        """The reserved block no owner is ever lent: the target of padding writes."""
        return self.num_blocks

    def run_block_ops(self, ops: Sequence[BlockOp]) -> None:
        """Runs BlockOps (COPY, OFFLOAD, RESTORE) as if one by one, in
        order: a slot or block freed by one may be reused by a later one. Consecutive operations
        of a kind go in one batch while none touches what another of the batch writes."""
        batch: list[tuple[int, int]] = []
        kind, sources, targets = None, set(), set()
        for op_kind, source, target in [*ops, (None, None, None)]:
            conflict = source in targets or target in targets or target in sources
            if batch and (op_kind != kind or conflict):
                self._run_batch(kind, batch)
                batch, sources, targets = [], set(), set()
            kind = op_kind
            batch.append((source, target))
            sources.add(source)
            targets.add(target)

    def _run_batch(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        if kind == COPY:
            self.copy_blocks(pairs)
            return
        if kind not in (OFFLOAD, RESTORE):
            raise ValueError(f"unknown block operation {kind!r}; known: {COPY}, {OFFLOAD}, {RESTORE}")
        if self.store is None:
            raise ValueError(f"a {kind} needs a pool with a store")
        sources, targets = (list(side) for side in zip(*pairs, strict=True))
        if kind == OFFLOAD:
            self.store.offload(self.layer_tensors, sources, targets)
        else:
            self.store.restore(self.layer_tensors, sources, targets)

    def copy_blocks(self, pairs) -> None:
        """Copies block `src` over block `dst` in every layer's K and V, for each (src, dst) in
        `pairs` (copy-on-write of a shared prefix's last block). Queued on the device's stream,
        so it lands after earlier steps wrote `src` and before later ones read `dst`."""
        if not pairs:
            return
        src, dst = zip(*pairs, strict=True)
        for name, ids in (("src", src), ("dst", dst)):
            if any(not 0 <= block < self.num_blocks for block in ids):
                raise ValueError(f"{name} blocks {ids} must be in 0..{self.num_blocks - 1}")
        if len(set(dst)) != len(dst) or set(src) & set(dst):
            raise ValueError(f"copy targets {dst} must be distinct and not among the sources {src}")
        device = self.kv_layers[0][0].device
        src_ids, dst_ids = torch.tensor((src, dst), dtype=torch.long).to(device, non_blocking=True)
        for blocks in self._stacked_layers:
            blocks = blocks.view(torch.uint8)  # the same memory: index_copy_ has no fp8 kernels
            blocks.index_copy_(1, dst_ids, blocks.index_select(1, src_ids))


def num_blocks_for_memory(shape: KVCacheShape, kv_bytes_budget: int) -> int:
    """The most lendable blocks a PagedKVPool can have within `kv_bytes_budget` bytes.

    One block of the budget goes to the reserved null block.
    """
    num_blocks = kv_bytes_budget // shape.bytes_per_block() - 1
    if num_blocks < 1:
        raise ValueError(
            f"kv_bytes_budget {kv_bytes_budget} holds fewer than 2 blocks of {shape.bytes_per_block()} bytes "
            "(one is the reserved null block); give the cache more memory or use a smaller block_size"
        )
    return num_blocks


def kv_budget_from_free_memory(
    device: torch.device | str,
    fraction: float,
    *,
    memory_limit_bytes: int | None = None,
    held_back_bytes: int = 0,
) -> int:
    """`fraction` of the device memory free now, less `held_back_bytes` (what serving needs
    besides the pool), in bytes: a budget for num_blocks_for_memory(). The rest of the free memory
    is slack for the allocator. With `memory_limit_bytes`, free memory is at most that limit less
    what this process's allocator holds already.

    CUDA only; call it after the weights are loaded, so what they take is not counted as free.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"cannot read free memory of device {str(device)!r}, only of CUDA devices; "
            "pass num_blocks to PagedKVPool explicitly"
        )
    free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
    if memory_limit_bytes is not None:
        free_bytes = min(free_bytes, max(0, memory_limit_bytes - torch.cuda.memory_reserved(device)))
    return max(0, int(free_bytes * fraction) - held_back_bytes)
