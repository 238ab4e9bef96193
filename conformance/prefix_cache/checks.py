"""Checks for specs/prefix_cache: random prefix-tree call sequences against a brute-force model.

Every check runs the same hypothesis state machine and asserts only its own clause. The model is
flat: `paths` maps every cached block's whole token path (from the root to the block's last
token) to that block, its lock count and its last use; matching is the longest common prefix
with any path, found by comparing against all of them, and the evictable blocks are the paths no
other path extends. Sequences come from a 3-token vocabulary, so they share prefixes and part
inside blocks all the time.
"""

from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from conformance.prefix_cache.two_tiers import two_tiers_keep_contents  # noqa: F401  (PFX-009)
from conformance.state_machines import run_machine
from infer.cache import BlockAllocator, LockError, MatchKind, PrefixTree

# implementation name (applies_to) -> (allocator, block_size, max_blocks) -> the tree under test.
TREES: dict[str, Callable[..., object]] = {
    "PrefixTree": lambda allocator, block_size, max_blocks: PrefixTree(
        allocator, block_size, max_blocks=max_blocks
    ),
}
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=10)


def match_is_longest_common_prefix(case: dict, impl: str) -> None:
    _run(case, impl, "match_is_longest_common_prefix")


def match_kinds(case: dict, impl: str) -> None:
    _run(case, impl, "match_kinds")
    _constructed_kinds(case, impl)


def reuse_is_token_granular(case: dict, impl: str) -> None:
    _run(case, impl, "reuse_is_token_granular")


def lock_count_never_negative(case: dict, impl: str) -> None:
    _run(case, impl, "lock_count_never_negative")


def locked_never_evicted(case: dict, impl: str) -> None:
    _constructed_lock_survives_eviction(case, impl)
    _run(case, impl, "locked_never_evicted")


def eviction_frees_unlocked_leaves_lru(case: dict, impl: str) -> None:
    _run(case, impl, "eviction_frees_unlocked_leaves_lru")


def entries_are_the_runs_between_branches(case: dict, impl: str) -> None:
    _run(case, impl, "entries_are_the_runs_between_branches")


def no_leak(case: dict, impl: str) -> None:
    _run(case, impl, "no_leak")


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _constructed_lock_survives_eviction(case: dict, impl: str) -> None:
    """A locked match, then evict asking for every block: the random machine rarely asks for
    more than the unlocked ones, which is when a tree that ignores locks shows it."""
    size = case["block_size"]
    allocator = BlockAllocator(64)
    tree = TREES[impl](allocator, size, case.get("max_blocks"))
    for owner, tokens in (("a", [1] * (2 * size + 1)), ("b", [2] * (2 * size))):
        tree.insert(tokens, allocator.allocate(-(-len(tokens) // size), owner))
        allocator.free_owner(owner)
    match = tree.match([1] * (2 * size + 1))
    tree.lock(match)
    locked = {*match.block_ids, match.copy_block} - {None}
    evicted = set(tree.evict(64))
    assert not evicted & locked, f"evict freed locked blocks {sorted(evicted & locked)}"


def _constructed_kinds(case: dict, impl: str) -> None:
    """One sequence of each kind, built on purpose: the random machine finds them rarely."""
    size = case["block_size"]
    allocator = BlockAllocator(64)
    tree = TREES[impl](allocator, size, None)
    cached = [7] * (2 * size + 1) + [8]
    blocks = allocator.allocate(-(-len(cached) // size), "req")
    tree.insert(cached, blocks)
    allocator.free_owner("req")
    cases = {
        MatchKind.PREFIX: cached + [9, 9],
        MatchKind.SUPERSEQUENCE: cached[:-2],
        MatchKind.LCP: cached[:-1] + [9],
        MatchKind.MISS: [9] + cached,
    }
    for kind, query in cases.items():
        got = tree.match(query).kind
        assert got is kind, f"match({query}) over a tree holding {cached} is {got}, expected {kind}"


def _run(case: dict, impl: str, clause: str) -> None:
    if impl not in TREES:
        raise ValueError(f"no factory for implementation {impl!r}; add it to TREES in {__file__}")
    machine = _machine_for(TREES[impl], case, clause)
    run_machine(machine, case)


def _machine_for(make, case: dict, clause: str) -> type:
    size, num_blocks, max_blocks = case["block_size"], case["num_blocks"], case.get("max_blocks")

    class TreeMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.allocator = BlockAllocator(num_blocks)
            self.tree = make(self.allocator, size, max_blocks)
            # The model: path -> {"block", "locks", "used", "hits"}; `clock` orders uses like the
            # tree's; "hits" are the count_hit calls whose last reused token is in the path's block.
            self.paths: dict[tuple[int, ...], dict] = {}
            self.clock = 0
            self.inserted: set[tuple[int, ...]] = set()
            self.locked: list = []  # (match, the model paths it locked)
            self.num_requests = 0

        # -- the model ----------------------------------------------------------------------------

        def model_matched(self, query) -> int:
            return max((_lcp(path, query) for path in self.paths), default=0)

        def model_path_of(self, block: int) -> tuple[int, ...]:
            (path,) = [p for p, node in self.paths.items() if node["block"] == block]
            return path

        def block_paths(self, path) -> list[tuple[int, ...]]:
            """The model paths of the blocks from the root down to the block holding path's end."""
            return [path[: min(end, len(path))] for end in range(size, len(path) + size, size)]

        def is_leaf(self, path) -> bool:
            """No path is a child of it (a partial block never has one)."""
            if len(path) % size:
                return True
            return not any(
                len(path) < len(other) <= len(path) + size and other[: len(path)] == path
                for other in self.paths
            )

        def evictable_leaves(self) -> list[tuple[int, ...]]:
            return [p for p, node in self.paths.items() if not node["locks"] and self.is_leaf(p)]

        def parent_path(self, path) -> tuple[int, ...]:
            return path[: (len(path) - 1) // size * size]

        def children(self, path) -> list[tuple[int, ...]]:
            if len(path) % size:  # a partial block is always a leaf
                return []
            n = len(path)
            return [p for p in self.paths if n < len(p) <= n + size and p[:n] == path]

        def drop(self, path) -> None:
            """The path's block left the tree: its hits go to the block above (none at the top)."""
            node = self.paths.pop(path)
            if self.parent_path(path) in self.paths:
                self.paths[self.parent_path(path)]["hits"] += node["hits"]

        def model_entries(self) -> list[tuple[int, int, int, int]]:
            """(start, tokens, blocks, hits) of each run: from a path under the root or a branch,
            down while the path has exactly one child; hits over the run's whole subtree."""
            heads = [p for p in self.paths if len(p) <= size or len(self.children(self.parent_path(p))) != 1]
            entries = []
            for head in heads:
                path, blocks = head, 1
                while len(self.children(path)) == 1:
                    (path,) = self.children(path)
                    blocks += 1
                below = [
                    node["hits"]
                    for p, node in self.paths.items()
                    if p == head or (len(head) % size == 0 and len(p) > len(head) and p[: len(head)] == head)
                ]
                start = len(self.parent_path(head))
                entries.append((start, len(path) - start, blocks, sum(below)))
            return sorted(entries)

        def touch(self, paths) -> None:
            self.clock += 1
            for path in paths:
                self.paths[path]["used"] = self.clock

        def checking(self, name: str) -> bool:
            return clause == name

        # -- rules ----------------------------------------------------------------------------------

        @rule(tokens=TOKENS)
        def insert(self, tokens):
            num = -(-len(tokens) // size)
            if num > self.allocator.num_free:
                self.make_room(num)
                if num > self.allocator.num_free:
                    return
            owner = f"req-{self.num_requests}"
            self.num_requests += 1
            blocks = self.allocator.allocate(num, owner)
            before = set(self.tree.block_ids())
            taken = self.tree.insert(tokens, blocks)
            evicted_by_budget = (before | set(taken)) - set(self.tree.block_ids())
            self.allocator.free_owner(owner)
            self.inserted.add(tuple(tokens))
            # Model: every block prefix of the sequence is cached; a shorter partial path that a
            # new path extends inside the same block is absorbed (gone unless locked).
            new_paths = []
            for path, block in zip(self.block_paths(tuple(tokens)), blocks, strict=False):
                same_block = [p for p in self.paths if (len(p) - 1) // size == (len(path) - 1) // size]
                holder = [p for p in same_block if len(p) >= len(path) and p[: len(path)] == path]
                if holder:
                    new_paths.append(holder[0])
                    continue
                assert block in taken, f"insert({tokens}) did not take block {block} for new tokens {path}"
                self.paths[path] = {"block": block, "locks": 0, "used": 0, "hits": 0}
                new_paths.append(path)
                for other in same_block:
                    if (
                        len(other) < len(path)
                        and path[: len(other)] == other
                        and not self.paths[other]["locks"]
                    ):
                        self.drop(other)
            self.touch(new_paths)
            # Blocks gone in this insert besides those the model absorbed: evicted for max_blocks.
            model_blocks = {node["block"]: path for path, node in self.paths.items()}
            for block in evicted_by_budget & set(model_blocks):
                path = model_blocks[block]
                if self.checking("locked_never_evicted"):
                    assert not self.paths[path]["locks"], (
                        f"insert over max_blocks evicted locked block {block}"
                    )
                self.drop(path)

        def make_room(self, num):
            evicted = self.tree.evict(num - self.allocator.num_free)
            for block in evicted:
                self.drop(self.model_path_of(block))

        @rule(query=TOKENS, cap=st.integers(min_value=0, max_value=12) | st.none(), lock=st.booleans())
        def match(self, query, cap, lock):
            before = (self.tree.block_ids(), self.allocator.num_free)
            m = self.tree.match(query, max_tokens=cap)
            assert (self.tree.block_ids(), self.allocator.num_free) == before, "match changed the tree"
            expected = self.model_matched(query)
            if self.checking("match_is_longest_common_prefix"):
                assert m.num_matched == expected, (
                    f"match({query}) agreed on {m.num_matched} tokens; the longest common prefix with a "
                    f"cached path is {expected}"
                )
            if self.checking("match_kinds"):
                if expected == 0:
                    assert m.kind is MatchKind.MISS, f"match({query}) = {m.kind} with nothing agreeing"
                elif m.kind is MatchKind.SUPERSEQUENCE:
                    assert m.num_matched == len(query), f"supersequence but only {m.num_matched} of {query}"
                elif m.kind is MatchKind.LCP:
                    assert m.num_matched < len(query), f"lcp but all of {query} is in the tree"
                elif m.kind is MatchKind.PREFIX:
                    assert tuple(query[: m.num_matched]) in self.inserted, (
                        f"prefix, but {query[: m.num_matched]} was never inserted"
                    )
                else:
                    raise AssertionError(f"match({query}) = miss with {expected} tokens agreeing")
            if self.checking("reuse_is_token_granular"):
                limit = expected if cap is None else min(expected, cap)
                assert m.num_tokens == limit, f"reused {m.num_tokens}, expected {limit}"
                assert m.num_tokens == len(m.block_ids) * size + m.copy_tokens
                assert (m.copy_block is None) == (m.copy_tokens == 0) and m.copy_tokens < size
                paths = self.block_paths(tuple(query[: m.num_tokens]))
                for path, block in zip(paths, m.block_ids, strict=False):
                    assert len(path) % size == 0, f"shared block {block} is not whole inside the reuse"
                    assert self.paths[path]["block"] == block, f"shared block {block} holds other tokens"
                if m.copy_block is not None:
                    copied = self.model_path_of(m.copy_block)
                    start = len(m.block_ids) * size
                    assert copied[start : start + m.copy_tokens] == tuple(query[start : m.num_tokens])
                    assert m.copy_block not in m.block_ids
            if not m.num_tokens:
                return
            # The block of the last token reused: where count_hit counts, lock starts from.
            last = self.model_path_of(m.copy_block if m.copy_block is not None else m.block_ids[-1])
            self.tree.count_hit(m, m.num_tokens)
            self.paths[last]["hits"] += 1
            if lock:
                self.tree.lock(m)
                held = self.block_paths(last)
                for path in held:
                    self.paths[path]["locks"] += 1
                self.touch(held)
                self.locked.append((m, held))

        @precondition(lambda self: self.locked)
        @rule(index=st.integers(min_value=0))
        def unlock(self, index):
            m, held = self.locked.pop(index % len(self.locked))
            self.tree.unlock(m)
            for path in held:
                self.paths[path]["locks"] -= 1
            # Once a block of the match has no lock left, unlocking it again must be refused
            # (while other matches lock all of its blocks, the counts cannot tell them apart).
            if self.checking("lock_count_never_negative") and any(not self.paths[p]["locks"] for p in held):
                before = (self.tree.num_locked_blocks, self.tree.num_evictable_blocks, self.tree.block_ids())
                try:
                    self.tree.unlock(m)
                except LockError:
                    pass
                else:
                    raise AssertionError("unlock of a match holding no lock did not raise LockError")
                after = (self.tree.num_locked_blocks, self.tree.num_evictable_blocks, self.tree.block_ids())
                assert after == before, "a refused unlock changed lock counts"

        @rule(num=st.integers(min_value=0, max_value=6))
        def evict(self, num):
            num_unlocked = sum(1 for node in self.paths.values() if not node["locks"])
            evicted = self.tree.evict(num)
            if self.checking("eviction_frees_unlocked_leaves_lru"):
                assert len(evicted) == min(num, num_unlocked), (
                    f"evict({num}) freed {len(evicted)} blocks with {num_unlocked} unlocked"
                )
            for block in evicted:
                path = self.model_path_of(block)
                if self.checking("locked_never_evicted"):
                    assert not self.paths[path]["locks"], f"evict freed locked block {block}"
                if self.checking("eviction_frees_unlocked_leaves_lru"):
                    leaves = self.evictable_leaves()
                    assert path in leaves, f"evicted block {block} ({path}) is not an unlocked leaf"
                    oldest = min(self.paths[p]["used"] for p in leaves)
                    assert self.paths[path]["used"] == oldest, (
                        f"evicted {path}, not a least recently used leaf"
                    )
                    assert self.allocator.refcount(block) == 0, f"evicted block {block} is still held"
                self.drop(path)

        @invariant()
        def tree_holds_the_model(self):
            if self.checking("no_leak"):
                tree_blocks = sorted(self.tree.block_ids())
                model_blocks = sorted(node["block"] for node in self.paths.values())
                assert tree_blocks == model_blocks, f"tree holds {tree_blocks}, the model {model_blocks}"
                held = sorted(self.allocator.owned_by(self.tree.owner))
                assert held == tree_blocks, f"the allocator's tree blocks {held} != the tree's {tree_blocks}"
                assert self.allocator.num_used == len(tree_blocks), "a block is held by a finished request"
                locked = sum(1 for node in self.paths.values() if node["locks"])
                assert self.tree.num_locked_blocks == locked, (
                    f"the tree counts {self.tree.num_locked_blocks} locked blocks, the model {locked}"
                )
                assert self.tree.num_evictable_blocks == len(tree_blocks) - locked

        @invariant()
        def entries_are_the_model_runs(self):
            if self.checking("entries_are_the_runs_between_branches"):
                entries = self.tree.entries()
                got = sorted((e.start, e.num_tokens, e.num_blocks, e.hits) for e in entries)
                assert got == self.model_entries(), f"entries() gives {got}, the model {self.model_entries()}"
                assert sum(e.num_blocks for e in entries) == self.tree.num_blocks

        def teardown(self):
            if self.checking("no_leak"):
                for m, _ in self.locked:
                    self.tree.unlock(m)
                self.tree.clear()
                assert self.tree.num_blocks == 0 and self.allocator.num_used == 0, (
                    f"after unlocking and clear(), {self.allocator.num_used} blocks are still held"
                )

    return TreeMachine
