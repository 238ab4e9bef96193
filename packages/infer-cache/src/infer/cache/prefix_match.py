"""PrefixMatch: what the prefix tree (infer.cache.prefix_tree) holds of a token sequence, as
`PrefixTree.match` finds it; a request that reuses it `lock`s it, and `unlock`s it when done.

What a match is (counted apart by the engine):
- prefix: the reused tokens are a whole sequence the tree holds (the request extends it, or is it);
- supersequence: the request's tokens all lie inside a longer sequence the tree holds;
- lcp: they part inside a sequence (same system prompt, another question; an edited last turn).
Every kind reuses the same shared blocks, so a match always takes the most tokens the tree
agrees on; the kind only names where the match ended.
"""

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from infer.cache.prefix_node import Node


class MatchKind(enum.Enum):
    MISS = "miss"
    PREFIX = "prefix"
    SUPERSEQUENCE = "supersequence"
    LCP = "lcp"


@dataclass(frozen=True)
class PrefixMatch:
    """What the tree holds of a token sequence (from `PrefixTree.match`).

    `num_tokens` tokens are reused: the `block_ids` (whole blocks, shared read only) and then
    `copy_tokens` tokens at the start of `copy_block`, which the request copies into a block of
    its own. `num_matched` is how far the tree agreed before `max_tokens` capped the reuse.
    """

    kind: MatchKind
    num_tokens: int
    num_matched: int
    block_ids: tuple[int, ...] = ()
    copy_block: int | None = None
    copy_tokens: int = 0
    # Nodes the reuse reads that are in the store now: `PrefixTree.warm` them before sharing.
    num_cold: int = 0
    # The nodes the reuse reads: the shared blocks', then the copy source's.
    _read: tuple[Node, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def reading(
        cls, kind: MatchKind, num_tokens: int, num_matched: int, read: Sequence[Node], copy_tokens: int
    ) -> "PrefixMatch":
        """The match whose reuse reads the nodes `read`: the shared blocks', then, with
        `copy_tokens`, the copy source's."""
        shared = read[:-1] if copy_tokens else read
        return cls(
            kind,
            num_tokens,
            num_matched,
            tuple(node.block for node in shared),
            read[-1].block if copy_tokens else None,
            copy_tokens,
            sum(node.slot is not None for node in read),
            tuple(read),
        )

    @property
    def _last_node(self) -> Node | None:
        """The deepest node the reuse reads: what lock() and unlock() walk up from (None when
        nothing is reused)."""
        return self._read[-1] if self._read else None


MISS = PrefixMatch(MatchKind.MISS, 0, 0)
