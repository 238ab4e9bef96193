"""What the engine needs from a KV pool and its block allocator, whichever implementation.

The runner reads `kv_layers`, `block_size` and `null_block`; the KV cache manager drives
`allocator`. Neither asks which pool it holds (STYLE: "Cache pools satisfy one protocol"), and
no code checks `isinstance` against these: they document the contract and type the arguments.
"""

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from infer.cache.shape import KVCacheShape

if TYPE_CHECKING:
    from infer.cache.kv_pool import BlockOp


@runtime_checkable
class BlockAllocatorProtocol(Protocol):
    """Refcounted lending of block ids 0..num_blocks-1 to named owners (see BlockAllocator).

    Every method that raises has changed nothing; the errors are infer.cache.CacheError's.
    """

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def usage_ratio(self) -> float: ...

    # Changes the allocator.
    def allocate(self, num_blocks: int, owner: str) -> list[int]: ...
    def share(self, block_ids: Iterable[int], owner: str) -> None: ...
    def free(self, block_ids: Iterable[int], owner: str) -> None: ...
    def free_owner(self, owner: str) -> list[int]: ...
    def reclaim(self, live_owners: Collection[str]) -> list[int]: ...

    # Reads only.
    def refcount(self, block: int) -> int: ...
    def owners_of(self, block: int) -> list[str]: ...
    def owned_by(self, owner: str) -> list[int]: ...
    def audit(self, live_owners: Collection[str]) -> list[int]: ...


@runtime_checkable
class KVPool(Protocol):
    # The model's KV geometry, dtype and tokens per block.
    shape: KVCacheShape
    # Lendable blocks, ids 0..num_blocks-1 (the null block is not among them).
    num_blocks: int
    allocator: BlockAllocatorProtocol

    @property
    def block_size(self) -> int: ...

    # The reserved block padding rows write to; never lent out.
    @property
    def null_block(self) -> int: ...

    # Per layer (k_cache, v_cache), each [num_blocks + 1, block_size, num_kv_heads, head_dim].
    @property
    def kv_layers(self) -> Sequence[tuple[torch.Tensor, torch.Tensor]]: ...

    # Per layer (k_scales, v_scales) of an fp8 cache (uint8 [num_blocks + 1, block_size,
    # num_kv_heads], infer.kernels.kv_fp8); None for any other dtype.
    @property
    def kv_scales(self) -> Sequence[tuple[torch.Tensor, torch.Tensor]] | None: ...

    # Bytes held by every K and V tensor together.
    @property
    def kv_bytes(self) -> int: ...

    # Copies block src over block dst in every layer, for each (src, dst) (copy-on-write).
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    # Runs kv_pool.BlockOps (COPY, OFFLOAD, RESTORE) in order.
    def run_block_ops(self, ops: Sequence["BlockOp"]) -> None: ...
