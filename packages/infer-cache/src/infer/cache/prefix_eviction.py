"""The prefix tree's eviction: which unlocked leaf goes next, in one LRU order over its tiers.

The tree (infer.cache.prefix_tree) marks each node's use (`last_access`) and links and unlinks
nodes; each tier (infer.cache.prefix_tiers) keeps a heap of its unlocked leaves. `Eviction`
compares the tiers' least recently used leaves, so that one LRU order spans the pool's blocks
and the store's slots. When the pool needs blocks, the store tier first offloads the least
recently used unlocked blocks of long enough sequences (a node offloaded stays in the tree, with
a slot instead of a block: nothing is forgotten), and only then do leaves in blocks go, least
recently used first, and stored leaves only when they stand in the way (a stored leaf frees no
block). When the store has no free slot, its least recently used stored leaf goes to make one.
"""

import math
from collections.abc import Callable, Iterable

from infer.cache.prefix_node import Node
from infer.cache.prefix_tiers import PoolTier, StoreTier, Tier


def _everything(node: Node) -> bool:
    return True


class Eviction:
    """Eviction over `pool`, and `store` when there is one. `remove(node)` is the tree's: it
    unlinks an evicted node and has its tier release the block or slot."""

    def __init__(self, pool: PoolTier, store: StoreTier | None, remove: Callable[[Node], None]):
        self.pool = pool
        self.store = store
        self.tiers: tuple[Tier, ...] = (pool,) if store is None else (pool, store)
        self._remove = remove
        self.num_evicted_blocks = 0  # pool blocks freed by eviction so far

    def note(self, node: Node) -> None:
        """Pushes the node's entries where it is a candidate now (see Tier.leaves)."""
        if node.parent is None or node.lock_count:
            return
        for tier in self.tiers:
            tier.note(node)
        if sum(tier.num_entries for tier in self.tiers) > 8 * len(self.pool.nodes) + 4096:
            # Drops the stale entries (amortized: after ~8 pushes per node).
            every = [held for tier in self.tiers for held in tier.nodes.values()]
            for tier in self.tiers:
                tier.rebuild(every)

    def evict(self, num_blocks: int) -> list[int]:
        """Frees up to `num_blocks` unlocked pool blocks, offloading first (see the module);
        returns the blocks freed (fewer when fewer are unlocked)."""
        freed = self._offload(num_blocks) if self.store is not None else []
        # Leaves in blocks first: a stored leaf frees no block, only what is in its way does.
        freed += self._evict_while(num_blocks - len(freed), _everything, tiers=(self.pool,))
        return freed + self._evict_while(num_blocks - len(freed), _everything)

    def evict_idle(self, cutoff_s: float) -> list[int]:
        """Frees every unlocked block last used before `cutoff_s` (leaves first), or with the
        store's `idle_to_store` moves them into the store; returns the pool blocks freed."""
        if self.store is not None and self.store.idle_to_store:
            return self._offload(math.inf, lambda node: node.last_access_s < cutoff_s)
        return self._evict_while(math.inf, lambda node: node.last_access_s < cutoff_s)

    def clear(self) -> list[int]:
        """Evicts every unlocked node, stored ones too; returns the pool blocks freed."""
        return self._evict_while(math.inf, _everything)

    def _offload(self, num_blocks: float, wanted=_everything) -> list[int]:
        """The store tier's `offload`, evicting its least recently used stored leaf when it
        needs a slot, and noting each node moved."""
        store = self.store

        def drop_oldest() -> bool:
            return self._evict_one((store,), _everything) is not None

        return store.offload(num_blocks, wanted, drop_oldest=drop_oldest, note=self.note)

    def _evict_while(self, num_blocks: float, wanted, *, tiers: Iterable[Tier] | None = None) -> list[int]:
        """Evicts unlocked leaves of `tiers` (None: all), least recently used first across them,
        until `num_blocks` pool blocks are freed or the next leaf is not `wanted` (the rest were
        used later); a stored leaf goes on the way, freeing a slot. Returns the blocks freed."""
        evicted: list[int] = []
        while len(evicted) < num_blocks:
            node = self._evict_one(self.tiers if tiers is None else tiers, wanted)
            if node is None:
                break
            if node.slot is None:
                evicted.append(node.block)
        self.num_evicted_blocks += len(evicted)
        return evicted

    def _evict_one(self, tiers: Iterable[Tier], wanted) -> Node | None:
        """Evicts the least recently used unlocked leaf of `tiers` if `wanted`; returns it, or None
        when there is none or it is not wanted."""
        oldest = [(entry, tier) for tier in tiers if (entry := tier.oldest_leaf()) is not None]
        if not oldest:
            return None
        entry, tier = min(oldest, key=lambda pair: pair[0])  # on a tie, the first tier's
        node = tier.nodes[entry[-1]]
        if not wanted(node):
            return None
        tier.pop_leaf()
        self._remove(node)
        return node
