"""KVCacheManager: all the scheduler knows of KV memory.

A request's blocks grow with its tokens: token i lives in `request.block_ids[i // block_size]`,
so a request holding n computed (or about to be computed) tokens holds exactly
ceil(n / block_size) blocks, and a new block is taken only when a token crosses a block boundary
(specs/allocator ALLOC-013). The owner of every block is the request id, so the allocator's
`audit` finds the blocks of requests that are gone.

Which calls change the cache: `match` reads only; `allocate`, `rollback` and `free` change the
allocator and `request.block_ids` (rollback also `num_computed_tokens`). A call that cannot be
served changes nothing: `allocate` answers None instead of raising, because running out of blocks
is the scheduler's everyday signal to preempt, not an error.
"""

from infer.cache import BlockAllocator
from infer.engine.request import Request


class KVCacheManager:
    def __init__(self, allocator: BlockAllocator, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage_ratio(self) -> float:
        return self.allocator.usage_ratio

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks `allocate` would take for these tokens (0 when the request's last block has room).
        Reads only."""
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        return max(0, self.blocks_for_tokens(total) - len(request.block_ids))

    def match(self, request: Request) -> int:
        """How many of the request's prompt tokens already have their K/V in the cache. Reads only.

        Always 0 for now: this is the seam for the prefix tree (infer.cache.prefix_tree), which
        will answer with the length of the longest cached run of the prompt, block-aligned.
        """
        return 0

    def allocate(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        """Grows `request.block_ids` to cover num_computed_tokens + num_new_tokens +
        num_lookahead_tokens tokens and returns the blocks added ([] when none was needed).

        None when the pool has fewer free blocks than that: nothing changes, and the caller
        preempts someone or waits.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_tokens and num_lookahead_tokens must be >= 0, got {num_new_tokens} "
                f"and {num_lookahead_tokens}"
            )
        num_blocks = self.num_new_blocks(request, num_new_tokens, num_lookahead_tokens)
        if num_blocks > self.allocator.num_free:
            return None
        new_block_ids = self.allocator.allocate(num_blocks, request.request_id)
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def rollback(self, request: Request, num_tokens: int) -> list[int]:
        """Forgets the last `num_tokens` computed tokens (rejected draft tokens, later) and frees
        the blocks the remaining ones no longer need; returns the freed block ids."""
        if not 0 <= num_tokens <= request.num_computed_tokens:
            raise ValueError(
                f"can roll back 0..{request.num_computed_tokens} computed tokens of "
                f"{request.request_id!r}, got {num_tokens}"
            )
        request.num_computed_tokens -= num_tokens
        keep = self.blocks_for_tokens(request.num_computed_tokens)
        freed = request.block_ids[keep:]
        self.allocator.free(freed, request.request_id)
        del request.block_ids[keep:]
        return freed

    def free(self, request: Request) -> None:
        """Every block of the request back to the pool; `request.block_ids` is then empty."""
        self.allocator.free(request.block_ids, request.request_id)
        request.block_ids = []
