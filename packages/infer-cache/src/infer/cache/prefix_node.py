"""Node: one block of the prefix tree (infer.cache.prefix_tree), shared by the tree, its tiers
(infer.cache.prefix_tiers) and its report (infer.cache.prefix_entries).

A node holds the token ids of one KV block and where their K/V is: a pool block (`block`), or,
offloaded to the second tier, a slot of the pool's store (`slot`, with `block` = -1 - slot). The
tree links nodes, counts their locks and marks their use (`last_access`: the one LRU order, which
every tier's heaps are keyed by).
"""

from dataclasses import dataclass, field


# slots: a node is one object (no __dict__), since a tree holds one per cached block and every
# object the engine keeps alive lengthens Python's garbage collections.
@dataclass(eq=False, slots=True)
class Node:
    tokens: tuple[int, ...]
    block: int
    parent: "Node | None"
    # first token -> (token run -> child)
    children: dict[int, dict[tuple[int, ...], "Node"]] = field(default_factory=dict)
    lock_count: int = 0
    slot: int | None = None  # the second tier: the node holds a slot of the store, not a block
    reach: int = 0  # the longest sequence inserted through this node, in tokens
    depth: int = 0  # tokens from the root to this node's end
    last_access: int = 0  # the tree's operation counter: LRU order without clock ties
    last_access_s: float = 0.0
    created_s: float = 0.0
    # Reuses whose last token is in this node (and in nodes evicted below it since): a run's
    # hits are the sum over its subtree (see infer.cache.prefix_entries).
    hits: int = 0
    # Offsets (1..len(tokens)) at which an inserted sequence ended in this node.
    # (A frozenset: most nodes end nothing, and share the one empty frozenset.)
    ends: frozenset[int] = frozenset()

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def child_runs(self, first_token: int) -> dict[tuple[int, ...], "Node"]:
        return self.children.get(first_token, {})
