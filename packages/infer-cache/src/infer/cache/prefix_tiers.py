"""The prefix tree's tiers: where its nodes' K/V is, and which of them eviction takes next.

`PrefixTree` (infer.cache.prefix_tree) is the trie: it matches, inserts, locks and removes nodes,
and keeps one LRU order over all of them (each node's `last_access`), which its eviction
(infer.cache.prefix_eviction) follows. Each node's K/V is in one tier, and the tree and its
eviction reach every tier through the one interface `Tier`:

- `nodes`: the tier's nodes, by pool block or by slot;
- `note(node)`: the node may be an eviction candidate now (made, used, unlocked, or a leaf since
  its last child went), so the tier pushes it onto its heaps;
- `oldest_leaf()`: the tier's least recently used unlocked leaf, as its heap entry (which the
  eviction compares across tiers), and `pop_leaf()` to take it; the tree then removes the node;
- `release(node)`: the node left the tree, so its block or slot goes back to the allocator.

`PoolTier` is the pool's blocks, always there. `StoreTier` is the second tier, when the tree is
given `slots` (the allocator of the pool's store: int8 blocks on the device, or blocks in host
memory; infer.cache.kv_pool), and is how the tree makes room in the pool without forgetting
anything: `offload` moves the least recently used unlocked blocks of sequences of at least
`store_min_tokens` tokens into free slots (when none is free, the eviction takes its least
recently used stored leaf), each node staying in the tree with a slot instead of a block.
`take_offloaded` gives the (block, slot) copies to run before the block's next owner writes it;
`restore` (for `PrefixTree.warm`) moves stored nodes back into pool blocks and gives the
(slot, block) copies to run before anything reads them. It counts the blocks offloaded,
restored, and the stored ones dropped.

Why the split: the tree's code is the same whatever holds the K/V, and a tier's (which
allocator, what moving a node out of the pool takes) the same whatever the tree's shape; the LRU
order stays the tree's, so its eviction takes leaves of both tiers in one order.
"""

import heapq
from collections.abc import Callable

from infer.cache.block_allocator import BlockAllocator
from infer.cache.prefix_node import Node


class Tier:
    """Nodes whose K/V the units of one allocator hold (pool blocks, or slots of the store), and
    the unlocked leaves among them, least recently used first."""

    def __init__(self, allocator: BlockAllocator, owner: str):
        self.allocator = allocator
        self.owner = owner
        self.nodes: dict[int, Node] = {}  # block (or slot) -> node
        # The tier's unlocked leaves, kept as the tree changes so that taking one costs
        # O(log n), not a scan of the tree: a heap of (last_access, block or slot) entries,
        # pushed whenever a node may have become a candidate (the tree notes it: created, used,
        # unlocked, its last child gone) and checked when popped (an entry whose node has changed
        # or gone since is stale and skipped). Entries hold ints only, which the garbage
        # collector does not track.
        self.leaves: list = []

    def key(self, node: Node) -> int:
        """The unit of this tier the node holds."""
        raise NotImplementedError

    def holds(self, node: Node) -> bool:
        """Whether the node's K/V is in this tier."""
        raise NotImplementedError

    def note(self, node: Node, push=heapq.heappush) -> None:
        """Pushes the node's entries where it is a candidate now; the tree calls it for unlocked
        nodes below a root only."""
        if node.is_leaf and self.holds(node):
            push(self.leaves, (node.last_access, self.key(node)))

    @property
    def num_entries(self) -> int:
        """Entries in the heaps, stale ones too."""
        return len(self.leaves)

    def rebuild(self, nodes: list[Node]) -> None:
        """The heaps again from `nodes` (every node of every tier), without the stale entries."""
        self.leaves = []
        for node in nodes:
            if not node.lock_count:
                self.note(node, push=list.append)
        heapq.heapify(self.leaves)

    def oldest_leaf(self) -> tuple | None:
        """The heap's least recently used valid leaf entry (stale ones popped), or None."""
        heap = self.leaves
        while heap:
            entry = heap[0]
            node = self.nodes.get(entry[-1])
            if node is not None and node.is_leaf and not node.lock_count and node.last_access == entry[0]:
                return entry
            heapq.heappop(heap)
        return None

    def pop_leaf(self) -> None:
        """Takes the entry `oldest_leaf` returned off the candidates (the tree removes its node)."""
        heapq.heappop(self.leaves)

    def release(self, node: Node) -> None:
        """The node has left the tree: its block or slot goes back to the allocator."""
        key = self.key(node)
        del self.nodes[key]
        self.allocator.free([key], self.owner)


class PoolTier(Tier):
    """The pool's blocks the tree holds (one reference each, for the tree's owner)."""

    def key(self, node: Node) -> int:
        return node.block

    def holds(self, node: Node) -> bool:
        return node.slot is None


class StoreTier(Tier):
    """The slots of the pool's store the tree holds (see the module): blocks offloaded from
    `pool` that the tree keeps."""

    def __init__(
        self,
        slots: BlockAllocator,
        owner: str,
        pool: PoolTier,
        *,
        store_min_tokens: int,
        idle_to_store: bool,
    ):
        super().__init__(slots, owner)
        self.pool = pool
        self.store_min_tokens = store_min_tokens
        # PrefixTree.evict_idle moves idle blocks into the store and leaves stored ones there (a
        # store in host memory: what it is for is the sessions that went idle).
        self.idle_to_store = idle_to_store
        # Unlocked nodes in pool blocks, the candidates to offload: a heap of (last_access,
        # -depth, block) entries, kept as `leaves` is.
        self.to_offload: list = []
        self._offloaded: list[tuple[int, int]] = []  # (block, slot) copies not taken yet
        # Blocks offloaded into the store, restored from it, and stored ones dropped, so far.
        self.num_offloaded_total = 0
        self.num_restored_total = 0
        self.num_dropped_total = 0

    def key(self, node: Node) -> int:
        return node.slot

    def holds(self, node: Node) -> bool:
        return node.slot is not None

    def note(self, node: Node, push=heapq.heappush) -> None:
        super().note(node, push)
        if node.slot is None:
            push(self.to_offload, (node.last_access, -node.depth, node.block))

    @property
    def num_entries(self) -> int:
        return len(self.leaves) + len(self.to_offload)

    def rebuild(self, nodes: list[Node]) -> None:
        self.to_offload = []
        super().rebuild(nodes)
        heapq.heapify(self.to_offload)

    def release(self, node: Node) -> None:
        super().release(node)
        self.num_dropped_total += 1

    def offload(
        self,
        num_blocks: float,
        wanted: Callable[[Node], bool],
        *,
        drop_oldest: Callable[[], bool],
        note: Callable[[Node], None],
    ) -> list[int]:
        """Moves up to `num_blocks` least recently used unlocked blocks of long enough sequences
        into slots (of one insert, the same tick, the deepest first), until the next is not
        `wanted`; when no slot is free, `drop_oldest()` (the eviction taking its least recently
        used stored leaf) frees one, and when it cannot, offloading stops. Each node moved is
        `note`d (by the eviction). Returns the blocks freed; their copies wait for take_offloaded."""
        freed: list[int] = []
        while len(freed) < num_blocks and self.to_offload:
            entry = heapq.heappop(self.to_offload)
            node = self.pool.nodes.get(entry[-1])
            if node is None or node.lock_count or node.last_access != entry[0]:
                continue
            if node.reach < self.store_min_tokens:
                continue  # pushed again if a longer sequence goes through it
            if not wanted(node):  # the rest were used later
                heapq.heappush(self.to_offload, entry)
                break
            if not self.allocator.num_free and not drop_oldest():
                heapq.heappush(self.to_offload, entry)
                break
            (slot,) = self.allocator.allocate(1, self.owner)
            block = node.block
            self._offloaded.append((block, slot))
            self.pool.release(node)
            node.slot, node.block = slot, -1 - slot
            self.nodes[slot] = node
            note(node)
            freed.append(block)
        self.num_offloaded_total += len(freed)
        return freed

    def take_offloaded(self) -> list[tuple[int, int]]:
        """The (block, slot) copies of the blocks offloaded since the last call; forgets them."""
        offloaded, self._offloaded = self._offloaded, []
        return offloaded

    def restore(self, nodes: list[Node], blocks) -> list[tuple[int, int]]:
        """Moves these stored nodes into pool `blocks` (one each, in order, already the tree's),
        freeing their slots; returns the (slot, block) restores to run before anything reads the
        blocks."""
        restores = []
        for node, block in zip(nodes, blocks, strict=True):
            restores.append((node.slot, int(block)))
            self.allocator.free([node.slot], self.owner)
            del self.nodes[node.slot]
            node.slot, node.block = None, int(block)
            self.pool.nodes[node.block] = node
        self.num_restored_total += len(nodes)
        return restores
