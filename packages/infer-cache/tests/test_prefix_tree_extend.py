"""PrefixTree.extend against the operations it stands for: on random requests that give their
blocks chunk by chunk and then finish, a tree driven by extend and one driven by insert, match,
lock and unlock stay the same tree (blocks, locks, matches, and the order eviction takes), with
int8 slots too (the order blocks are quantized in is the LRU order of every node, not only of
leaves)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.cache import MISS, BlockAllocator, PrefixTree

BS = 4
NUM_BLOCKS = 40

SEQUENCES = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=14)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), SEQUENCES),
        st.tuples(st.just("grow"), st.integers(min_value=0), st.integers(min_value=1, max_value=3)),
        st.tuples(st.just("finish"), st.integers(min_value=0), st.integers(min_value=0)),
        st.tuples(st.just("evict"), st.integers(min_value=0, max_value=5)),
        st.tuples(st.just("probe"), SEQUENCES),
    ),
    max_size=40,
)


class Side:
    """One tree and its requests: {name: [tokens, blocks, held match, given blocks]}."""

    def __init__(self, num_slots: int):
        self.allocator = BlockAllocator(NUM_BLOCKS)
        slots = BlockAllocator(num_slots) if num_slots else None
        self.tree = PrefixTree(self.allocator, BS, slots=slots, store_min_tokens=BS)
        self.requests: dict[str, list] = {}

    def state(self):
        tree = self.tree
        return (
            tree.block_ids(), tree.num_locked_blocks, tree.num_evictable_blocks, self.allocator.num_free,
            tree.num_stored_blocks, tree.take_offloaded(),
        )  # fmt: skip


def by_extend(side: Side, name: str, num_tokens: int, *, finish: bool) -> list[int]:
    tokens, blocks, held, _ = side.requests[name]
    taken, match = side.tree.extend(held, tokens[:num_tokens], blocks, end=finish, lock=not finish)
    side.requests[name][2] = match
    return taken


def by_composition(side: Side, name: str, num_tokens: int, *, finish: bool) -> list[int]:
    tokens, blocks, held, _ = side.requests[name]
    tree = side.tree
    if finish:
        if held is not MISS:
            tree.unlock(held)
        return tree.insert(tokens[:num_tokens], blocks, end=True)
    taken = tree.insert(tokens[:num_tokens], blocks, end=False)
    match = tree.match(tokens[:num_tokens])
    tree.lock(match)
    if held is not MISS:
        tree.unlock(held)
    side.requests[name][2] = match
    return taken


@pytest.mark.parametrize("num_slots", [0, 6])
@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_extend_is_insert_match_lock_and_unlock_of_the_lock_it_held(num_slots, ops):
    a, b = Side(num_slots), Side(num_slots)
    sides = ((a, by_extend), (b, by_composition))
    count = 0
    for op in ops:
        live = sorted(a.requests)
        if op[0] == "start":
            tokens = op[1]
            num = -(-len(tokens) // BS)
            if num > a.allocator.num_free:
                assert a.tree.evict(num - a.allocator.num_free) == b.tree.evict(num - b.allocator.num_free)
            if num > a.allocator.num_free:
                continue
            name = f"req-{count}"
            count += 1
            for side, _ in sides:
                side.requests[name] = [tokens, side.allocator.allocate(num, name), MISS, 0]
        elif op[0] in ("grow", "finish") and live:
            name = live[op[1] % len(live)]
            tokens, _, _, given_blocks = a.requests[name]
            if op[0] == "grow":
                given_blocks = min(given_blocks + op[2], len(tokens) // BS)
                num_tokens = given_blocks * BS
                if num_tokens == 0:
                    continue
            else:
                num_tokens = given_blocks * BS + op[2] % (len(tokens) - given_blocks * BS + 1)
            finish = op[0] == "finish"
            taken = [run(side, name, num_tokens, finish=finish) for side, run in sides]
            assert taken[0] == taken[1]
            if finish:
                for side, _ in sides:
                    side.allocator.free_owner(name)
                    del side.requests[name]
            else:
                held_a, held_b = a.requests[name][2], b.requests[name][2]
                assert (held_a.block_ids, held_a.num_tokens, held_a.copy_block) == (
                    held_b.block_ids,
                    held_b.num_tokens,
                    held_b.copy_block,
                )
                for side, _ in sides:
                    side.requests[name][3] = given_blocks
        elif op[0] == "evict":
            assert a.tree.evict(op[1]) == b.tree.evict(op[1])
        elif op[0] == "probe":
            found = [side.tree.match(op[1]) for side, _ in sides]
            assert [(m.kind, m.num_tokens, m.block_ids, m.copy_block) for m in found[:1]] == [
                (m.kind, m.num_tokens, m.block_ids, m.copy_block) for m in found[1:]
            ]
        assert a.state() == b.state()
    # Eviction order is the trees' LRU order: the same, block by block.
    for name in sorted(a.requests):
        tokens, _, _, given_blocks = a.requests[name]
        for side, run in sides:
            run(side, name, given_blocks * BS, finish=True)
            side.allocator.free_owner(name)
    while a.tree.num_blocks:
        assert a.tree.evict(1) == b.tree.evict(1)
        assert a.state() == b.state()
    assert a.tree.clear() == b.tree.clear()
    assert b.tree.num_blocks == 0 and a.allocator.num_free == b.allocator.num_free == NUM_BLOCKS
