"""The prefix-cache checks catch real bugs: each broken tree below fails its own clause's check
(and the correct PrefixTree passes them all, conformance/test_specs.py)."""

import dataclasses
import heapq

import pytest

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from conformance.state_machines import failure_messages
from infer.cache import PrefixTree

checks = load_checks_module(CHECKS_DIR, "prefix_cache")
FAST = {"block_size": 3, "num_blocks": 24, "max_examples": 100, "steps": 30}


class StopsOneTokenShort(PrefixTree):
    """A match that parts inside a block agrees on one token fewer than it could."""

    def match(self, token_ids, max_tokens=None):
        m = super().match(token_ids, max_tokens)
        if m.copy_tokens > 1:
            return dataclasses.replace(
                m, num_tokens=m.num_tokens - 1, num_matched=m.num_matched - 1, copy_tokens=m.copy_tokens - 1
            )
        return m


class CallsEverythingAPrefix(PrefixTree):
    def match(self, token_ids, max_tokens=None):
        m = super().match(token_ids, max_tokens)
        if m.kind.value != "miss":
            return dataclasses.replace(m, kind=type(m.kind).PREFIX)
        return m


class SharesTheBlockItEndsIn(PrefixTree):
    """The block a match ends inside is shared instead of copied."""

    def match(self, token_ids, max_tokens=None):
        m = super().match(token_ids, max_tokens)
        if m.copy_block is not None:
            return dataclasses.replace(
                m, block_ids=(*m.block_ids, m.copy_block), copy_block=None, copy_tokens=0
            )
        return m


class UnlocksBelowZero(PrefixTree):
    def unlock(self, match):
        node = match._last_node
        while node is not None and node.parent is not None:
            node.lock_count -= 1
            node = node.parent


class EvictsLockedLeaves(PrefixTree):
    def evict(self, num_blocks):
        saved = {}
        for node in self.pool_tier.nodes.values():
            saved[id(node)], node.lock_count = node.lock_count, 0
            self.eviction.note(node)
        try:
            return super().evict(num_blocks)
        finally:
            for node in self.pool_tier.nodes.values():
                node.lock_count = saved[id(node)]


class EvictsMostRecentlyUsed(PrefixTree):
    def evict(self, num_blocks):
        real_heapify, real_pop = heapq.heapify, heapq.heappop
        heapq.heapify = lambda heap: heap.sort(key=lambda item: -item[0])
        heapq.heappop = lambda heap: heap.pop(0)
        try:
            return super().evict(num_blocks)
        finally:
            heapq.heapify, heapq.heappop = real_heapify, real_pop


class KeepsEvictedBlocks(PrefixTree):
    """Eviction forgets the node but never drops the tree's reference to its block."""

    def _remove(self, node):
        free = self.allocator.free
        self.allocator.free = lambda block_ids, owner: None
        try:
            super()._remove(node)
        finally:
            self.allocator.free = free


class LosesHitsOnEviction(PrefixTree):
    """A run's hits go with the blocks they were counted in."""

    def _remove(self, node):
        node.hits = 0
        super()._remove(node)


class SplitsRunsAtSequenceEnds(PrefixTree):
    """A sequence ending inside a chain (an earlier turn of a conversation) starts a new run."""

    def entries(self):
        for node in self.pool_tier.nodes.values():
            if node.ends and len(node.children) == 1:
                node.children = {**node.children, -1: {}}  # a second key: looks like a branch
        try:
            return super().entries()
        finally:
            for node in self.pool_tier.nodes.values():
                node.children.pop(-1, None)


class RestoresEveryBlockIntoTheFirst(PrefixTree):
    """A warm whose restores all land in the first of the blocks it was given."""

    def warm(self, match, blocks):
        warmed, restores = super().warm(match, blocks)
        return warmed, [(slot, restores[0][1]) for slot, _ in restores]


class KeepsDroppedSlots(PrefixTree):
    """A stored leaf that goes keeps its slot."""

    def _remove(self, node):
        slot = node.slot
        super()._remove(node)
        if slot is not None:
            self.store_tier.allocator.allocate(1, self.owner)


def two_tier_messages(broken, case: dict, *, says: str) -> list[str]:
    from conformance.prefix_cache.two_tiers import TWO_TIER_TREES

    TWO_TIER_TREES["Broken"] = broken
    try:
        return failure_messages(checks.two_tiers_keep_contents, case, "Broken", (says,))
    finally:
        del TWO_TIER_TREES["Broken"]


@pytest.mark.parametrize(
    ("broken", "says"),
    [(RestoresEveryBlockIntoTheFirst, "shares block"), (KeepsDroppedSlots, "slots")],
    ids=lambda value: value.__name__ if isinstance(value, type) else "",
)
def test_broken_two_tier_tree_fails_pfx_009(broken, says):
    # Blocks of one token: deep paths, so one match often restores several blocks at once.
    case = {"block_size": 1, "num_blocks": 10, "num_slots": 20, "min_tokens": 0, "max_examples": 300}
    case["steps"] = 40
    messages = two_tier_messages(broken, case, says=says)
    assert messages, f"two_tiers_keep_contents passed {broken.__name__}"
    assert any(says in message for message in messages), messages


def assertion_messages(check, broken, case: dict, *, says: str) -> list[str]:
    """The AssertionErrors a check raises on the broken tree (`failure_messages`)."""
    checks.TREES["Broken"] = lambda allocator, block_size, max_blocks: broken(
        allocator, block_size, max_blocks=max_blocks
    )
    try:
        return failure_messages(check, case, "Broken", (says,))
    finally:
        del checks.TREES["Broken"]


@pytest.mark.parametrize(
    ("broken", "check", "says", "case"),
    [
        (StopsOneTokenShort, checks.match_is_longest_common_prefix, "longest common prefix", {}),
        (CallsEverythingAPrefix, checks.match_kinds, "prefix", {}),
        (SharesTheBlockItEndsIn, checks.reuse_is_token_granular, "", {}),
        (UnlocksBelowZero, checks.lock_count_never_negative, "did not raise LockError", {}),
        (EvictsLockedLeaves, checks.locked_never_evicted, "locked block", {}),
        (EvictsMostRecentlyUsed, checks.eviction_frees_unlocked_leaves_lru, "least recently used", {}),
        (KeepsEvictedBlocks, checks.no_leak, "", {}),
        # Blocks of one token make deep trees, where evicted blocks have a parent to give hits to.
        (LosesHitsOnEviction, checks.entries_are_the_runs_between_branches, "entries()", {"block_size": 1}),
        (SplitsRunsAtSequenceEnds, checks.entries_are_the_runs_between_branches, "entries()", {}),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else "",
)
def test_broken_tree_fails_its_clause(broken, check, says, case):
    messages = assertion_messages(check, broken, {**FAST, **case}, says=says)
    assert messages, f"{check.__name__} passed {broken.__name__}"
    assert any(says in message for message in messages), messages
