"""PrefixTree: the token runs that requests leave behind, over the KV blocks that hold them.

A trie whose nodes are KV blocks. A node holds one block of the pool and the token ids whose K/V
are in it (at most block_size); the path from the root to a node spells the first tokens of a
sequence, block by block. Because a node is exactly one physical block, a node never splits: two
sequences that part inside a block have two nodes for it (two blocks, siblings), and a node with
fewer than block_size tokens (a sequence's last, partial block) is always a leaf. Children are
found by their whole token run (a dict per first token), so a walk costs one lookup per block.

Reuse is token-granular. `match` walks as long as the tokens agree, into the middle of a block
when they part there. The blocks wholly inside the match are shared, read only: a request
writes only positions after them. The block where the match ends inside is never shared: the
request copies its first tokens into a block of its own (`PrefixMatch.copy_block`,
copy-on-write), because it will write the rest of that block.

What a match is, and its kinds (prefix, supersequence, lcp): infer.cache.prefix_match.

Memory. The tree holds each of its blocks with one reference in the pool's BlockAllocator (owner
`owner`). A request that reuses a match takes its own references to the shared blocks and
`lock`s the match: the lock count of each node from the deepest one the match used up to the root
goes up by one, and a locked node is never evicted. `evict` frees unlocked leaves, least recently
used first (a parent whose last child went is a leaf in turn); `evict_idle` those not used for a
while; `max_blocks` caps the tree after each insert.

Layers. This module is the trie: how its nodes (infer.cache.prefix_node) are matched, inserted,
locked and unlinked. Where a node's K/V is belongs to its tier (infer.cache.prefix_tiers): the
pool's blocks, and with `slots` (the allocator of the pool's store: int8 blocks on the device, or
blocks in host memory) the store's slots; a node offloaded into the store stays in the tree with
a slot instead of a block. Which unlocked leaf goes next, in one LRU order over both tiers, is
infer.cache.prefix_eviction: when the pool needs blocks, the store tier first offloads the least
recently used unlocked blocks of sequences of at least `store_min_tokens` tokens
(`take_offloaded` gives the copies to run), and only then do leaves go. A match reads stored
nodes like the others; `warm` moves them back into pool blocks before a request shares them.
What the tree holds, for people (`entries`: the runs of tokens between branches), is
infer.cache.prefix_entries.

Which calls change the tree: `match` and `entries` read only (not even the LRU clock); `lock`,
`unlock`, `count_hit`, `insert`, `extend`, `evict`, `evict_idle`, `clear`, `discard` and `warm`
change it. A call that raises has changed nothing.
"""

import itertools
import time
from collections.abc import Sequence

from infer.cache.block_allocator import BlockAllocator
from infer.cache.errors import LockError
from infer.cache.prefix_entries import PrefixEntry, prefix_entries
from infer.cache.prefix_eviction import Eviction
from infer.cache.prefix_match import MISS, MatchKind, PrefixMatch
from infer.cache.prefix_node import Node
from infer.cache.prefix_tiers import PoolTier, StoreTier

TREE_OWNER = "prefix-cache"


class PrefixTree:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        owner: str = TREE_OWNER,
        max_blocks: int | None = None,
        clock=time.monotonic,
        slots: BlockAllocator | None = None,
        store_min_tokens: int = 256,
        idle_to_store: bool = False,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be None or >= 0, got {max_blocks}")
        self.allocator = allocator
        self.block_size = block_size
        self.owner = owner
        self.max_blocks = max_blocks
        self._clock = clock
        # One root per cache salt (None: no salt): sequences under different salts never meet.
        self._roots: dict[str | None, Node] = {}
        self._tick = itertools.count(1)
        self._num_locked = 0  # nodes in blocks with lock_count > 0
        # Where the nodes' K/V is (infer.cache.prefix_tiers): the pool's blocks, then the store's.
        self.pool_tier = PoolTier(allocator, owner)
        self.store_tier: StoreTier | None = None
        if slots is not None:
            self.store_tier = StoreTier(
                slots, owner, self.pool_tier, store_min_tokens=store_min_tokens, idle_to_store=idle_to_store
            )
        # Which unlocked leaf goes next, across the tiers (infer.cache.prefix_eviction).
        self.eviction = Eviction(self.pool_tier, self.store_tier, self._remove)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Pool blocks the tree holds."""
        return len(self.pool_tier.nodes)

    @property
    def num_locked_blocks(self) -> int:
        return self._num_locked

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks `evict` could free now: every unlocked node in a block (a locked node's ancestors
        are locked too, so the unlocked ones all become leaves as eviction goes on)."""
        return len(self.pool_tier.nodes) - self._num_locked

    def block_ids(self) -> list[int]:
        return sorted(self.pool_tier.nodes)

    # The counters the tiers and the eviction keep, for the engine's stats (the store's are 0
    # without a store): slots of the store the tree holds; blocks offloaded into the store,
    # restored from it, and stored ones dropped (evicted from it) so far; pool blocks evicted.

    @property
    def num_stored_blocks(self) -> int:
        return len(self.store_tier.nodes) if self.store_tier else 0

    @property
    def num_offloaded_total(self) -> int:
        return self.store_tier.num_offloaded_total if self.store_tier else 0

    @property
    def num_restored_total(self) -> int:
        return self.store_tier.num_restored_total if self.store_tier else 0

    @property
    def num_dropped_total(self) -> int:
        return self.store_tier.num_dropped_total if self.store_tier else 0

    @property
    def num_evicted_blocks(self) -> int:
        return self.eviction.num_evicted_blocks

    def match(
        self, token_ids: Sequence[int], max_tokens: int | None = None, *, salt: str | None = None
    ) -> PrefixMatch:
        """The longest run of `token_ids` the tree holds under `salt`, reusing at most
        `max_tokens` of it (None: all; an engine passes len - 1, so that the last prompt token is
        computed and gives logits). Reads only."""
        tokens = tuple(token_ids)
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be None or >= 0, got {max_tokens}")
        size = self.block_size
        path: list[Node] = []  # wholly matched nodes
        node, depth = self._roots.get(salt), 0
        if node is None:
            return MISS
        tail, tail_tokens = None, 0  # a node matched part-way (or a shorter node wholly)
        while depth < len(tokens):
            chunk = tokens[depth : depth + size]
            runs = node.child_runs(chunk[0])
            child = runs.get(chunk) if len(chunk) == size else None
            if child is not None:
                path.append(child)
                node, depth = child, depth + size
                continue
            for candidate in runs.values():
                agreed = _common_prefix(candidate.tokens, chunk)
                if agreed > tail_tokens:
                    tail, tail_tokens = candidate, agreed
            break
        num_matched = depth + tail_tokens
        if num_matched == 0:
            return MISS
        kind = self._kind(tokens, num_matched, path, tail, tail_tokens)
        reuse = num_matched if max_tokens is None else min(num_matched, max_tokens)
        if reuse == 0:
            return PrefixMatch(kind, 0, num_matched)
        num_shared = reuse // size
        copy_tokens = reuse - num_shared * size
        read = path[:num_shared]
        if copy_tokens:  # the copy source: the next node, or the one matched part-way
            read.append(path[num_shared] if num_shared < len(path) else tail)
        return PrefixMatch.reading(kind, reuse, num_matched, read, copy_tokens)

    @staticmethod
    def _kind(tokens, num_matched, path, tail, tail_tokens) -> MatchKind:
        if tail is not None:
            at_sequence_end = tail_tokens in tail.ends
        else:
            at_sequence_end = bool(path) and len(path[-1].tokens) in path[-1].ends
        if at_sequence_end:
            return MatchKind.PREFIX
        return MatchKind.SUPERSEQUENCE if num_matched == len(tokens) else MatchKind.LCP

    def entries(self) -> list[PrefixEntry]:
        """The runs of cached tokens between branches, parents before their children
        (infer.cache.prefix_entries). Reads only; walks every node (O(blocks held))."""
        return prefix_entries(self._roots.values())

    # -- changing --------------------------------------------------------------------------------

    def lock(self, match: PrefixMatch) -> None:
        """The match's nodes, and all above them, can no longer be evicted; marks them used."""
        tick, now = next(self._tick), self._clock()
        for node in _path_up(match._last_node):
            self._take_lock(node)
            node.last_access, node.last_access_s = tick, now

    def unlock(self, match: PrefixMatch) -> None:
        """Undoes one lock(match). LockError (changing nothing) if it holds no lock."""
        path = list(_path_up(match._last_node))
        for node in path:
            if node.lock_count < 1:
                raise LockError(
                    f"block {node.block} is not locked; unlock each match exactly once after lock()"
                )
        for node in path:
            self._give_lock(node)

    def count_hit(self, match: PrefixMatch, num_tokens: int) -> None:
        """Counts one reuse of the match's first `num_tokens` tokens (what a request took of it)
        for `entries`' hits."""
        if num_tokens > 0:
            match._read[min((num_tokens - 1) // self.block_size, len(match._read) - 1)].hits += 1

    def warm(self, match: PrefixMatch, blocks: Sequence[int]) -> tuple[PrefixMatch, list[tuple[int, int]]]:
        """Moves the match's stored nodes into `blocks` (match.num_cold of them, the tree's: taken
        from the allocator for `owner`), in order, freeing their slots. Returns the match as it
        reads now, and the (slot, block) restores to run before anything reads the blocks."""
        cold = [node for node in match._read if node.slot is not None]
        if len(cold) != len(blocks):
            raise ValueError(f"the match reads {len(cold)} stored blocks, got {len(blocks)} blocks for them")
        restores = self.store_tier.restore(cold, blocks) if cold else []
        self._num_locked += sum(node.lock_count > 0 for node in cold)
        warmed = PrefixMatch.reading(
            match.kind, match.num_tokens, match.num_matched, match._read, match.copy_tokens
        )
        return warmed, restores

    def take_offloaded(self) -> list[tuple[int, int]]:
        """The (block, slot) copies of the blocks offloaded since the last call; forgets them."""
        return self.store_tier.take_offloaded() if self.store_tier else []

    def insert(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        salt: str | None = None,
        end: bool = True,
    ) -> list[int]:
        """Adds the sequence (under `salt`) whose token i has its K/V in
        `block_ids[i // block_size]`: each block whose tokens the tree does not hold yet joins it
        (the tree takes a reference), and the sequence's end is marked unless `end` is False (the
        first blocks of a request still running: a later match that stops there is no prefix of
        anything a request left). Returns the blocks the tree took; the caller keeps (and later
        frees) its own references to every block. Then evicts down to `max_blocks`.

        ValueError (changing nothing) when a block to take is free or already in the tree."""
        return self.extend(MISS, token_ids, block_ids, salt=salt, end=end, lock=False)[0]

    def extend(
        self,
        held: PrefixMatch,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        salt: str | None = None,
        end: bool = True,
        lock: bool = True,
    ) -> tuple[list[int], PrefixMatch | None]:
        """`insert(token_ids, block_ids)` for a sequence whose first `held.num_tokens` tokens are
        `held`, a locked match of whole blocks (a running request's, from an earlier extend; MISS
        for none), that then moves held's lock onto the whole sequence (`lock`), or gives it up.
        Returns the blocks the tree took and, with `lock`, the match that holds the lock now.

        The same as insert, then `m = match(token_ids); lock(m)` (with `lock`), then
        `unlock(held)`, but the walk starts where `held` ends: a request that gives the tree its
        blocks chunk by chunk, and its whole sequence when it finishes, costs the tree its new
        blocks, not its whole path each time.

        ValueError (changing nothing) as insert, or when `held` is not such a match of these
        tokens."""
        tokens = tuple(token_ids)
        self._check_extend(held, tokens, len(block_ids))
        if not tokens:
            return [], held if lock else None
        size, top = self.block_size, held._last_node
        num_blocks = -(-len(tokens) // size)
        # Walk what the tree holds below `held`; the blocks from the first miss on are new.
        chunks = [tokens[i : i + size] for i in range(held.num_tokens, num_blocks * size, size)]
        path: list[Node] = []
        root = self._roots.get(salt) or Node((), -1, None)
        node = top if top is not None else root
        for chunk in chunks:
            child = self._holder(node, chunk)
            if child is None:
                break
            path.append(child)
            node = child
        new_blocks = self._blocks_to_take(block_ids[held.num_tokens // size + len(path) : num_blocks])
        tick, now = next(self._tick), self._clock()
        self.allocator.share(new_blocks, self.owner)
        self._roots[salt] = root
        for chunk, block in zip(chunks[len(path) :], new_blocks, strict=True):
            node = self._add_child(node, chunk, block, now)
            path.append(node)
        last = node
        if end:
            last.ends |= {len(tokens) - (num_blocks - 1) * size}
        # One walk up the whole sequence: each node marked used (and how long a sequence went
        # through it); below `held`, locked with `lock`, else noted (a candidate now); from
        # `held` up, its lock kept with `lock`, else given up.
        below_held = True
        for node in _path_up(last):
            below_held = below_held and node is not top
            node.last_access, node.last_access_s = tick, now
            node.reach = max(node.reach, len(tokens))
            if below_held and lock:
                self._take_lock(node)
            elif below_held:
                self.eviction.note(node)
            elif not lock:
                self._give_lock(node)
        match = self._whole_match(held, tokens, path, last) if lock else None
        if self.max_blocks is not None and self.num_blocks > self.max_blocks:
            self.evict(self.num_blocks - self.max_blocks)
        return new_blocks, match

    def _check_extend(self, held: PrefixMatch, tokens: tuple[int, ...], num_block_ids: int) -> None:
        """extend's checks of its arguments, before it changes anything."""
        size = self.block_size
        num_blocks = -(-len(tokens) // size)
        if num_block_ids < num_blocks:
            raise ValueError(
                f"{len(tokens)} tokens need {num_blocks} blocks of {size}, got {num_block_ids} block ids"
            )
        start, top = held.num_tokens, held._last_node
        if (
            held.copy_tokens
            or start > len(tokens)
            or (top is not None and (top.depth != start or top.tokens != tokens[start - size : start]))
        ):
            raise ValueError(
                f"held must be a match of whole blocks of these tokens; it reuses {start} tokens "
                f"(copying {held.copy_tokens}) of {len(tokens)}"
            )
        if top is not None and top.lock_count < 1:
            raise LockError(f"block {top.block} is not locked; extend moves the lock of a locked match")

    def _blocks_to_take(self, block_ids: Sequence[int]) -> list[int]:
        """The blocks for the tree's new nodes, checked: each in use, in the tree not yet, once."""
        new_blocks = [int(block) for block in block_ids]
        for block in new_blocks:
            if block in self.pool_tier.nodes:
                raise ValueError(f"block {block} already holds other tokens in the tree")
            if self.allocator.refcount(block) == 0:
                raise ValueError(f"block {block} is free; insert the blocks that hold the tokens")
        if len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"block ids repeat in {new_blocks}")
        return new_blocks

    def _add_child(self, node: Node, chunk: tuple[int, ...], block: int, now: float) -> Node:
        """A new node below `node` for `chunk`, in `block` (the tree's reference taken)."""
        runs = node.children.setdefault(chunk[0], {})
        child = Node(chunk, block, node, depth=node.depth + len(chunk), created_s=now)
        runs[chunk] = child
        self.pool_tier.nodes[block] = child
        # Shorter (partial, so leaf) siblings whose tokens start the child's are redundant now:
        # their sequence ends move to the child, and the unlocked ones go (their blocks freed).
        for sibling in list(runs.values()):
            if len(sibling.tokens) < len(chunk) and chunk[: len(sibling.tokens)] == sibling.tokens:
                child.ends |= sibling.ends
                if not sibling.lock_count:
                    self._remove(sibling)
        return child

    def _whole_match(
        self, held: PrefixMatch, tokens: tuple[int, ...], path: list[Node], last: Node
    ) -> PrefixMatch:
        """The match of all of `tokens` that extend leaves locked: `held`, then the nodes of
        `path`; `last` is the node the sequence ends in."""
        read = (*held._read, *path)
        num_shared = len(tokens) // self.block_size - held.num_tokens // self.block_size
        partial = len(tokens) % self.block_size
        return PrefixMatch(
            self._kind(tokens, len(tokens), read, None, 0),
            len(tokens),
            len(tokens),
            held.block_ids + tuple(node.block for node in path[:num_shared]),
            last.block if partial else None,
            partial,
            held.num_cold + sum(node.slot is not None for node in path),
            read,
        )

    def _take_lock(self, node: Node) -> None:
        self._num_locked += node.lock_count == 0 and node.slot is None
        node.lock_count += 1

    def _give_lock(self, node: Node) -> None:
        node.lock_count -= 1
        self._num_locked -= node.lock_count == 0 and node.slot is None
        self.eviction.note(node)  # a candidate now if that was its last lock

    def _holder(self, node: Node, chunk: tuple[int, ...]) -> Node | None:
        """The child of `node` that holds `chunk`'s tokens: the same run, or for a partial chunk a
        sibling that holds these tokens and more."""
        runs = node.child_runs(chunk[0])
        child = runs.get(chunk)
        if child is None and len(chunk) < self.block_size:
            child = next((c for c in runs.values() if c.tokens[: len(chunk)] == chunk), None)
        return child

    # -- evicting ------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> list[int]:
        """Frees up to `num_blocks` unlocked pool blocks: with `slots`, by offloading first, then
        by evicting least recently used leaves (infer.cache.prefix_eviction); returns the blocks
        freed (fewer when fewer are unlocked)."""
        return self.eviction.evict(num_blocks)

    def evict_idle(self, idle_s: float) -> list[int]:
        """Frees every unlocked block not used for `idle_s` seconds (leaves first); returns them.
        With `idle_to_store`, moves them into the store instead (`take_offloaded`), and what the
        store holds leaves it only when the store is full."""
        return self.eviction.evict_idle(self._clock() - idle_s)

    def clear(self) -> list[int]:
        """Evicts every unlocked node, stored ones too; returns the pool blocks freed."""
        return self.eviction.clear()

    def discard(self, block_ids: Sequence[int]) -> list[int]:
        """Takes these blocks out of the tree where they are unlocked leaves, the last first (the
        blocks a request gave while it ran, whose K/V a failed forward may have left wrong);
        returns those taken out. A block someone else's match has locked since stays."""
        discarded = []
        for block in reversed(block_ids):
            node = self.pool_tier.nodes.get(block)
            if node is not None and node.is_leaf and not node.lock_count:
                self._remove(node)
                discarded.append(block)
        return discarded

    def _remove(self, node: Node) -> None:
        parent = node.parent
        runs = parent.children[node.tokens[0]]
        del runs[node.tokens]
        if not runs:
            del parent.children[node.tokens[0]]
        if parent.parent is not None:
            parent.hits += node.hits  # the reuses that reached it reached its parent's run too
        if parent.parent is None and not parent.children:  # an empty root: its salt is gone
            del self._roots[next(salt for salt, root in self._roots.items() if root is parent)]
        (self.pool_tier if node.slot is None else self.store_tier).release(node)
        self.eviction.note(parent)  # it may be a leaf now


def _path_up(node: Node | None):
    """`node` and its ancestors, up to (not including) the root."""
    while node is not None and node.parent is not None:
        yield node
        node = node.parent


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
