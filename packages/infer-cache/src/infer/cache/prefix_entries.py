"""What the prefix tree holds, for people: `PrefixTree.entries` reports the runs of tokens between
branches, each with its size, its hits (`PrefixTree.count_hit`, once per request that reuses it)
and when it was made and last used. Reads the tree's nodes (infer.cache.prefix_node) only.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from infer.cache.prefix_node import Node


@dataclass(frozen=True)
class PrefixEntry:
    """A run of cached tokens with no branch inside (from `PrefixTree.entries`): tokens
    [start, start + num_tokens) of the sequences through it, in `num_blocks` pool blocks and
    `num_stored_blocks` slots of the store. `hits`: reuses that read into it (or into a run below it);
    times are the tree's clock."""

    start: int
    num_tokens: int
    num_blocks: int
    num_stored_blocks: int
    hits: int
    last_used_s: float
    created_s: float
    in_use: bool  # a running request reads it: it cannot be evicted now


def prefix_entries(roots: Iterable[Node]) -> list[PrefixEntry]:
    """The runs of cached tokens below `roots`, one per edge of the radix tree that the block trie
    spells: a run starts at a root or a branch and goes down while each node has one child, so
    that a shared system prompt is one entry and each conversation after it another. Parents come
    before their children. Walks every node (O(blocks held))."""
    runs: list[list] = []  # [head, tail, parent index, blocks, stored blocks, hits]
    for root in roots:
        stack = [(child, -1) for child_runs in root.children.values() for child in child_runs.values()]
        while stack:
            head, parent = stack.pop()
            node, blocks, cold, hits = head, 0, 0, 0
            while True:
                blocks += node.slot is None
                cold += node.slot is not None
                hits += node.hits
                if len(node.children) != 1:
                    break
                (child_runs,) = node.children.values()
                if len(child_runs) != 1:
                    break
                (node,) = child_runs.values()
            index = len(runs)
            runs.append([head, node, parent, blocks, cold, hits])
            stack.extend((c, index) for child_runs in node.children.values() for c in child_runs.values())
    for run in reversed(runs):  # children after parents: sum hits up the tree
        if run[2] >= 0:
            runs[run[2]][5] += run[5]
    return [
        PrefixEntry(
            start=head.depth - len(head.tokens),
            num_tokens=tail.depth - head.depth + len(head.tokens),
            num_blocks=blocks,
            num_stored_blocks=cold,
            hits=hits,
            # A use marks a node and every node above it: the head is the run's latest, and
            # was made no later than anything below it.
            last_used_s=head.last_access_s,
            created_s=head.created_s,
            in_use=head.lock_count > 0,
        )
        for head, tail, _, blocks, cold, hits in runs
    ]
