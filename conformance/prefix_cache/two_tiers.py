"""PFX-009: the prefix tree over two tiers (a pool and a store it offloads into), against a model
of what every block and slot holds.

The model runs the tree's block operations on contents, as the pool runs them on K/V. A block's
content is the whole token path it ends (as its K/V depends on every token before it, so no two
nodes hold the same): an insert writes each of its blocks' paths, `take_offloaded` copies a block into a slot
(and the block's next owner overwrites it), `warm` copies slots back into blocks. Then:
- a match, warmed, shares blocks (and a copy source) that hold exactly the tokens it reuses: a
  restored block is what was offloaded, through any number of trips;
- no leak across the tiers: the pool's tree blocks are the tree's, the store's used slots are
  the tree's stored blocks, each with one reference; after unlocking everything and clear(),
  both are empty;
- a locked block is never offloaded or evicted.
"""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conformance.state_machines import run_machine
from infer.cache import BlockAllocator, PrefixTree

# implementation name (applies_to) -> the tree class under test (conformance/tests adds broken ones).
TWO_TIER_TREES: dict[str, type] = {"PrefixTree": PrefixTree}
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=10)
# Written over a block whose tree node went to the store: the next owner's K/V.
OVERWRITTEN = (-1,)


def two_tiers_keep_contents(case: dict, impl: str | None) -> None:
    run_machine(_machine(TWO_TIER_TREES[impl or "PrefixTree"], case), case)


def _machine(tree_class: type, case: dict) -> type:
    size, num_blocks, num_slots = case["block_size"], case["num_blocks"], case["num_slots"]

    class TwoTierMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.allocator = BlockAllocator(num_blocks)
            self.slots = BlockAllocator(num_slots)
            self.tree = tree_class(
                self.allocator, size, slots=self.slots, store_min_tokens=case["min_tokens"]
            )
            self.blocks: dict[int, tuple[int, ...]] = {}  # the path each pool block holds
            self.stored: dict[int, tuple[int, ...]] = {}  # the path each slot holds
            self.locked: list = []  # (match, the blocks it shared when locked)
            self.num_requests = 0

        def run_offloads(self) -> None:
            """The tree's offloads since the last call, as the pool runs them; each offloaded
            block is then free, and its next owner overwrites it."""
            for block, slot in self.tree.take_offloaded():
                assert self.allocator.refcount(block) == 0, f"offloaded block {block} is still held"
                self.stored[slot] = self.blocks[block]
                self.blocks[block] = OVERWRITTEN

        def take(self, num: int, owner: str) -> list[int] | None:
            if num > self.allocator.num_free:
                self.tree.evict(num - self.allocator.num_free)
                self.run_offloads()
            if num > self.allocator.num_free:
                return None
            return self.allocator.allocate(num, owner)

        @rule(tokens=TOKENS)
        def insert(self, tokens):
            owner = f"req-{self.num_requests}"
            self.num_requests += 1
            blocks = self.take(-(-len(tokens) // size), owner)
            if blocks is None:
                return
            for index, block in enumerate(blocks):
                self.blocks[block] = tuple(tokens[: (index + 1) * size])
            self.tree.insert(tokens, blocks)
            self.run_offloads()
            self.allocator.free_owner(owner)

        @rule(query=TOKENS, lock=st.booleans())
        def match(self, query, lock):
            m = self.tree.match(query)
            if not m.num_tokens:
                return
            self.tree.lock(m)  # first: taking blocks to warm into must not evict the match
            if m.num_cold:
                blocks = self.take(m.num_cold, self.tree.owner)
                if blocks is None:
                    self.tree.unlock(m)
                    return
                m, restores = self.tree.warm(m, blocks)
                for slot, block in restores:
                    assert self.slots.refcount(slot) == 0, f"slot {slot} restored but still held"
                    self.blocks[block] = self.stored[slot]
            for index, block in enumerate(m.block_ids):
                want = tuple(query[: (index + 1) * size])
                assert self.blocks[block] == want, (
                    f"match({query}) shares block {block} holding {self.blocks[block]}, not {want}"
                )
            if m.copy_block is not None:
                held = self.blocks[m.copy_block][: m.num_tokens]
                assert held == tuple(query[: m.num_tokens]), (
                    f"match({query}) copies block {m.copy_block} holding {self.blocks[m.copy_block]}"
                )
            if lock:
                self.locked.append((m, [*m.block_ids, *([m.copy_block] if m.copy_block is not None else [])]))
            else:
                self.tree.unlock(m)

        @precondition(lambda self: self.locked)
        @rule(index=st.integers(min_value=0))
        def unlock(self, index):
            m, _ = self.locked.pop(index % len(self.locked))
            self.tree.unlock(m)

        @rule(num=st.integers(min_value=0, max_value=6))
        def evict(self, num):
            self.tree.evict(num)
            self.run_offloads()

        @invariant()
        def no_leak_across_tiers(self):
            tree_blocks = sorted(self.tree.block_ids())
            held = sorted(self.allocator.owned_by(self.tree.owner))
            assert held == tree_blocks, f"the allocator's tree blocks {held} != the tree's {tree_blocks}"
            assert self.allocator.num_used == len(tree_blocks), "a block is held by a finished request"
            assert self.slots.num_used == self.tree.num_stored_blocks, (
                f"{self.slots.num_used} slots used, the tree holds {self.tree.num_stored_blocks}"
            )
            for slot in self.slots.owned_by(self.tree.owner):
                assert self.slots.refcount(slot) == 1, f"slot {slot}: {self.slots.refcount(slot)} references"
            for _, blocks in self.locked:
                for block in blocks:
                    assert self.allocator.refcount(block) == 1 and block in tree_blocks, (
                        f"block {block} of a locked match left the pool"
                    )

        @rule()
        def clear(self):
            """Everything unlocked and cleared: both tiers empty. (A rule, not the teardown: a
            teardown's failure would hide the failure that ended the run.)"""
            for m, _ in self.locked:
                self.tree.unlock(m)
            self.locked = []
            self.tree.clear()
            assert self.tree.num_blocks == 0 and self.allocator.num_used == 0, (
                f"after clear(), {self.allocator.num_used} blocks are still held"
            )
            assert self.tree.num_stored_blocks == 0 and self.slots.num_used == 0, (
                f"after clear(), {self.slots.num_used} slots are still held"
            )

    return TwoTierMachine
