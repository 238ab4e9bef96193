"""KVCacheManager: all the scheduler knows of KV memory.

The manager holds each request's blocks, by request id: token i lives in
`block_ids(request_id)[i // block_size]`. They grow with its tokens, so a request holding n
computed (or about to be computed) tokens holds exactly ceil(n / block_size) blocks, and a new
block is taken only when a token crosses a block boundary (specs/allocator ALLOC-013). The owner
of every block is the request id, so the allocator's `audit` finds the blocks of requests that
are gone.

With a prefix tree (`use_prefix_caching`), a request admitted with no blocks starts from what the
tree holds of its tokens: `match` finds it (all but the last known token at most, which is
computed to give logits), `acquire` shares the match's whole blocks, locks it in the tree, and
takes a block of its own for the block the match ends inside, whose copy waits in
`take_block_ops` for the step's decision (the runner runs those before the forward). With a
second tier for what it evicts (the pool's store: int8 blocks, or host memory), the tree offloads
instead of evicting when blocks run short, and a match that reads stored blocks is first restored
into blocks of the tree's (operations of the decision too, in the order they were made); while
too few blocks are free for that, the request waits rather than recompute what is stored. While a
request runs, `cache_computed` gives the tree its whole computed prompt blocks after each prefill
chunk, so that requests admitted later with the same start (a burst of users of one system
prompt) reuse them at once; the request locks what it gave, as if it had matched it. When a
request leaves, `free` gives its computed tokens to the tree (its blocks gain the tree's
reference) before the request drops its own. Blocks only the tree holds are the free list's
reserve: `allocate` evicts the tree's least recently used unlocked blocks when the free list is
short, so `num_free_blocks` counts them as free.

Which calls change the cache: `match`, `block_ids` and `num_new_blocks` read only; `acquire`,
`cache_computed`, `allocate`, `rollback`, `release` and `free` change the allocator, the tree and
the blocks held for the request. None of them writes the request: the scheduler alone moves its
`num_computed_tokens`, from what they return (`acquire` the tokens reused, `rollback` the blocks
freed for the tokens it forgets; after `release`, or a preemption's `free`, none is computed). A
call that cannot be served changes nothing: `allocate` answers None instead of raising, because
running out of blocks is the scheduler's everyday signal to preempt, not an error.
"""

from collections import Counter

from infer.cache import COPY, MISS, OFFLOAD, RESTORE, BlockAllocator, BlockOp, PrefixMatch, PrefixTree
from infer.engine.request import Request


class KVCacheManager:
    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_tree: PrefixTree | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if prefix_tree is not None and prefix_tree.block_size != block_size:
            raise ValueError(
                f"the prefix tree's blocks hold {prefix_tree.block_size} tokens, the pool's {block_size}"
            )
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_tree = prefix_tree
        # Each request's KV blocks in order, while it holds any: token i lives in block i // block_size.
        self._blocks: dict[str, list[int]] = {}
        # The locked match of each request that reused one or gave blocks, until it leaves.
        self._matches: dict[str, PrefixMatch] = {}
        # Per running request: whole blocks given to the tree so far, and those the tree took.
        self._num_given_blocks: dict[str, int] = {}
        self._given: dict[str, list[int]] = {}
        # Block operations for the next decision, in order.
        self._ops: list[BlockOp] = []
        # Matches by kind at admission.
        self.match_counts: Counter[str] = Counter()
        self._kinds: dict[str, str] = {}  # the kind counted at each running request's admission
        # Seconds the runner spent moving blocks to and from the pool's store (RunnerOutput's).
        self.store_transfer_s = 0.0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free now, and those only the prefix tree holds (evicted on demand)."""
        tree = self.prefix_tree
        return self.allocator.num_free + (tree.num_evictable_blocks if tree is not None else 0)

    @property
    def usage_ratio(self) -> float:
        return self.allocator.usage_ratio

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's KV blocks in order (token i lives in block i // block_size); () while it
        holds none: waiting, preempted, or gone. Reads only."""
        return tuple(self._blocks.get(request_id, ()))

    def num_new_blocks(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks `allocate` would take for these tokens (0 when the request's last block has room).
        Reads only."""
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        return max(0, self.blocks_for_tokens(total) - len(self._blocks.get(request.request_id, ())))

    def match(self, request: Request) -> PrefixMatch:
        """What the prefix tree holds of the request's known tokens, all but the last at most.
        MISS without a tree, or for a request that holds blocks already. Reads only."""
        if self.prefix_tree is None or self._blocks.get(request.request_id) or request.bypass_prefix_cache:
            return MISS
        tokens = request.cache_key_ids
        return self.prefix_tree.match(tokens, max_tokens=len(tokens) - 1, salt=request.cache_salt)

    def acquire(self, request: Request, match: PrefixMatch) -> int | None:
        """The request (holding no blocks) starts from `match`: it shares the match's whole
        blocks, locks the match, and gets a block of its own for the block the match ends inside
        (copied before its first forward; without a free block it reuses the whole blocks only).
        Returns the tokens reused, which the caller counts as computed (0 without a prefix tree);
        None, changing nothing, when the match has stored blocks and too few blocks are free to
        restore them: the request waits for them (recomputing those tokens would take as many
        blocks, and the compute besides). `release` undoes it."""
        if self.prefix_tree is None or request.bypass_prefix_cache:
            return 0
        if match.num_tokens and self._blocks.get(request.request_id):
            raise ValueError(
                f"{request.request_id!r} holds blocks; only a request starting afresh takes a match"
            )
        tree = self.prefix_tree
        if match.num_tokens:
            tree.lock(match)  # first: evicting for the copy must not take the match's own blocks
            if match.num_cold:
                restored = self._take(match.num_cold, tree.owner)
                if restored is None:
                    tree.unlock(match)
                    return None
                match, restores = tree.warm(match, restored)
                self._ops.extend(BlockOp(RESTORE, slot, block) for slot, block in restores)
        self._kinds[request.request_id] = match.kind.value
        self.match_counts[match.kind.value] += 1
        if not match.num_tokens:
            return 0
        num_reused = len(match.block_ids) * self.block_size
        copy = None
        if match.copy_block is not None:
            taken = self._take(1, request.request_id)
            if taken is not None:
                copy = (match.copy_block, taken[0])
                num_reused = match.num_tokens
        if num_reused == 0:
            tree.unlock(match)
            return 0
        self.allocator.share(match.block_ids, request.request_id)
        self._blocks[request.request_id] = [*match.block_ids, *([copy[1]] if copy else [])]
        self._matches[request.request_id] = match
        tree.count_hit(match, num_reused)
        if copy is not None:
            self._ops.append(BlockOp(COPY, *copy))
        return num_reused

    def cache_computed(self, request: Request) -> None:
        """Gives the tree the request's whole computed blocks whose token ids are known (call
        after scheduling a prefill chunk: the step's forward writes their K/V before any later
        step's forward reads them), and moves the request's lock onto them."""
        tree = self.prefix_tree
        if tree is None or request.bypass_prefix_cache:
            return
        request_id = request.request_id
        tokens = request.cache_key_ids
        num_blocks = min(request.num_computed_tokens, len(tokens)) // self.block_size
        if num_blocks <= self._num_given_blocks.get(request_id, 0):
            return
        tokens = tokens[: num_blocks * self.block_size]
        blocks = self._blocks[request_id][:num_blocks]
        taken, self._matches[request_id] = tree.extend(
            self._held(request_id), tokens, blocks, salt=request.cache_salt, end=False
        )
        self._take_offloaded()  # when the insert went over max_blocks
        self._given.setdefault(request_id, []).extend(taken)
        self._num_given_blocks[request_id] = num_blocks

    def _held(self, request_id: str, num_tokens: int | None = None) -> PrefixMatch:
        """The request's locked match, for `PrefixTree.extend` to walk on from (and move the lock
        of): MISS, after unlocking it, when it is none extend can take (an acquired match ending
        inside the block the request copied, or one past `num_tokens`)."""
        match = self._matches.get(request_id)
        if match is None:
            return MISS
        if match.copy_tokens or (num_tokens is not None and match.num_tokens > num_tokens):
            self.prefix_tree.unlock(self._matches.pop(request_id))
            return MISS
        return match

    def take_block_ops(self) -> tuple[BlockOp, ...]:
        """The block operations made since the last call (copies and restores for the acquired
        matches, the tree's offloads), in order, for this step's decision; forgets them."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def allocate(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        """Grows the request's blocks to cover num_computed_tokens + num_new_tokens +
        num_lookahead_tokens tokens and returns the blocks added ([] when none was needed),
        evicting from the prefix tree when the free list is short.

        None when even then there are too few: no request changes, and the caller preempts
        someone or waits.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_tokens and num_lookahead_tokens must be >= 0, got {num_new_tokens} "
                f"and {num_lookahead_tokens}"
            )
        num_blocks = self.num_new_blocks(request, num_new_tokens, num_lookahead_tokens)
        if num_blocks == 0:  # the last block has room: most decode steps of most requests
            return []
        new_block_ids = self._take(num_blocks, request.request_id)
        if new_block_ids is None:
            return None
        if new_block_ids:
            self._blocks.setdefault(request.request_id, []).extend(new_block_ids)
        return new_block_ids

    def _take(self, num_blocks: int, owner: str) -> list[int] | None:
        """`num_blocks` blocks for `owner`, evicting from the tree when the free list is short;
        None (nothing evicted) when even that would not do."""
        if num_blocks > self.num_free_blocks:
            return None
        short = num_blocks - self.allocator.num_free
        if short > 0:
            self.prefix_tree.evict(short)
            self._take_offloaded()
        return self.allocator.allocate(num_blocks, owner)

    def evict_idle(self, idle_s: float) -> None:
        """The tree's entries idle for `idle_s` seconds leave the pool (for the store, with a host
        tier: their offloads go into the next decision, before any new owner writes the blocks)."""
        self.prefix_tree.evict_idle(idle_s)
        self._take_offloaded()

    def _take_offloaded(self) -> None:
        self._ops.extend(BlockOp(OFFLOAD, block, slot) for block, slot in self.prefix_tree.take_offloaded())

    def rollback(self, request: Request, num_tokens: int) -> list[int]:
        """Frees the blocks that the request's computed tokens but the last `num_tokens` (rejected
        draft tokens, later) no longer need, and returns them: the caller then takes `num_tokens`
        off its num_computed_tokens."""
        if not 0 <= num_tokens <= request.num_computed_tokens:
            raise ValueError(
                f"can roll back 0..{request.num_computed_tokens} computed tokens of "
                f"{request.request_id!r}, got {num_tokens}"
            )
        blocks = self._blocks.get(request.request_id, [])
        keep = self.blocks_for_tokens(request.num_computed_tokens - num_tokens)
        freed = blocks[keep:]
        self.allocator.free(freed, request.request_id)
        del blocks[keep:]
        if not blocks:
            self._blocks.pop(request.request_id, None)
        return freed

    def release(self, request: Request) -> None:
        """Undoes `acquire` (and any allocate since) for a request that is not admitted after all:
        nothing goes to the tree; the caller counts none of its tokens computed again. Without an
        acquire to undo (no prefix tree, or a request that bypasses it) it does nothing."""
        kind = self._kinds.pop(request.request_id, None)
        if kind is None:
            return
        self.match_counts[kind] -= 1  # not admitted: its match is counted when it is
        self.free(request, cache=False)

    def free(self, request: Request, *, cache: bool = True) -> None:
        """Every block of the request back to the pool; it then holds none. With a prefix tree
        and `cache`, its computed tokens whose ids are known go to the tree first (a failed
        forward's request passes cache=False: its K/V may be wrong, so what it gave while running
        is discarded too)."""
        blocks = self._blocks.pop(request.request_id, [])
        tree = self.prefix_tree
        if tree is not None:
            self._kinds.pop(request.request_id, None)
            self._num_given_blocks.pop(request.request_id, None)
            given = self._given.pop(request.request_id, [])
            tokens = request.cache_key_ids[: request.num_computed_tokens]
            insert = cache and bool(tokens) and not request.bypass_prefix_cache
            held = self._held(request.request_id, len(tokens))
            self._matches.pop(request.request_id, None)
            if not insert and held is not MISS:
                tree.unlock(held)
            if not cache and given:
                tree.discard(given)
            if self._ops:  # a copy into a block of a request that leaves before its step
                self._ops = [op for op in self._ops if op.kind != COPY or op.target not in blocks]
            if insert:
                # Inserts the whole sequence and gives up the request's lock, in one walk.
                computed = blocks[: self.blocks_for_tokens(len(tokens))]
                tree.extend(held, tokens, computed, salt=request.cache_salt, end=True, lock=False)
                self._take_offloaded()
        self.allocator.free(blocks, request.request_id)
