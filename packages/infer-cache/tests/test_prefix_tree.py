"""PrefixTree on hand-made sequences (blocks of 4 tokens): each match kind, token-granular reuse
with the copied block, locks, LRU eviction, budgets, and what the allocator sees.
The random-sequence checks against a brute-force model are specs/prefix_cache (conformance)."""

import pytest

from infer.cache import BlockAllocator, LockError, MatchKind, PrefixTree

BS = 4
SYSTEM = list(range(100, 110))  # 10 tokens: two full blocks and 2 tokens of a third


def tree_with(*sequences, num_blocks=64, **options):
    """A tree holding `sequences`, each inserted the way a finished request is: its own blocks,
    which it then frees (so only the tree's references remain)."""
    allocator = BlockAllocator(num_blocks)
    tree = PrefixTree(allocator, BS, **options)
    for i, tokens in enumerate(sequences):
        insert(tree, tokens, f"req-{i}")
    return tree, allocator


def insert(tree, tokens, owner):
    blocks = tree.allocator.allocate(-(-len(tokens) // BS), owner)
    taken = tree.insert(tokens, blocks)
    tree.allocator.free_owner(owner)
    return blocks, taken


def test_a_miss_reuses_nothing():
    tree, _ = tree_with(SYSTEM)
    match = tree.match([1, 2, 3, 4, 5])
    assert match.kind is MatchKind.MISS and match.num_tokens == 0 and not match.block_ids


def test_prefix_the_request_extends_a_cached_sequence():
    tree, _ = tree_with(SYSTEM)
    match = tree.match(SYSTEM + [7, 8, 9])
    assert match.kind is MatchKind.PREFIX and match.num_matched == 10 and match.num_tokens == 10
    # Two whole blocks shared; the partial third block's 2 tokens are copied, never shared.
    assert len(match.block_ids) == 2 and match.copy_tokens == 2 and match.copy_block is not None
    assert match.copy_block not in match.block_ids


def test_supersequence_reuses_all_but_the_last_prompt_token():
    tree, _ = tree_with(SYSTEM + [1, 2, 3, 4, 5, 6])
    prompt = SYSTEM[:8]
    match = tree.match(prompt, max_tokens=len(prompt) - 1)
    assert match.kind is MatchKind.SUPERSEQUENCE and match.num_matched == 8
    # 7 tokens: one shared block, then 3 copied from the second (the request writes token 7 there).
    assert match.num_tokens == 7 and len(match.block_ids) == 1 and match.copy_tokens == 3


def test_an_exact_hit_is_a_prefix_and_leaves_the_last_token_to_compute():
    tree, _ = tree_with(SYSTEM)
    match = tree.match(SYSTEM, max_tokens=len(SYSTEM) - 1)
    assert match.kind is MatchKind.PREFIX and match.num_tokens == 9
    assert len(match.block_ids) == 2 and match.copy_tokens == 1


def test_lcp_same_system_prompt_another_question_parts_inside_a_block():
    tree, _ = tree_with(SYSTEM + [1, 2, 3])
    match = tree.match(SYSTEM + [1, 9, 9, 9])
    # Agreed on 11 tokens: blocks 0-1 whole, then 3 tokens of block 2 (2 system + 1), copied.
    assert match.kind is MatchKind.LCP and match.num_tokens == 11
    assert len(match.block_ids) == 2 and match.copy_tokens == 3


def test_the_deepest_match_wins_over_a_shorter_cached_prefix():
    """A cached sequence that is a prefix of the request and a longer one that parts later: the
    match takes the longer agreement (the same shared blocks, more of them)."""
    tree, _ = tree_with(SYSTEM, SYSTEM + [1, 2, 3, 4, 5, 6])
    match = tree.match(SYSTEM + [1, 2, 3, 4, 9])
    assert match.num_tokens == 14 and match.kind is MatchKind.LCP


def test_a_sequence_shorter_than_a_block_matches_token_by_token():
    tree, _ = tree_with([5, 6])
    assert tree.match([5, 6, 7]).kind is MatchKind.PREFIX
    assert tree.match([5]).kind is MatchKind.SUPERSEQUENCE
    match = tree.match([5, 7])
    assert match.kind is MatchKind.LCP and match.num_tokens == 1 and match.copy_tokens == 1


def test_inserting_held_tokens_takes_no_block_and_keeps_the_first_copy():
    tree, allocator = tree_with(SYSTEM)
    first = tree.block_ids()
    _, taken = insert(tree, SYSTEM, "again")
    assert taken == [] and tree.block_ids() == first
    assert allocator.num_used == tree.num_blocks == 3


def test_a_full_block_absorbs_the_partial_block_it_extends():
    tree, allocator = tree_with(SYSTEM)  # blocks: 4 + 4 + partial 2
    partial = tree.match(SYSTEM).copy_block
    insert(tree, SYSTEM + [1, 2], "longer")  # the third block is now full: 100..109, 1, 2
    assert partial not in tree.block_ids() and allocator.refcount(partial) == 0
    assert tree.num_blocks == 3
    # SYSTEM is still a sequence the tree holds: a request extending it is a prefix hit.
    assert tree.match(SYSTEM + [7]).kind is MatchKind.PREFIX


def test_a_locked_partial_block_stays_until_unlocked_and_evicted():
    tree, allocator = tree_with(SYSTEM)
    match = tree.match(SYSTEM + [7])
    tree.lock(match)
    insert(tree, SYSTEM + [1, 2], "longer")
    assert match.copy_block in tree.block_ids()
    tree.unlock(match)
    assert match.copy_block in tree.evict(1)  # the least recently used leaf
    assert allocator.refcount(match.copy_block) == 0


def test_locked_nodes_and_their_ancestors_are_never_evicted():
    tree, allocator = tree_with(SYSTEM, [1, 2, 3, 4, 5])
    match = tree.match(SYSTEM + [0])
    tree.lock(match)
    evicted = tree.evict(100)
    assert set(tree.block_ids()) == set(match.block_ids) | {match.copy_block}
    assert not set(evicted) & set(tree.block_ids()) and len(evicted) == 2
    tree.unlock(match)
    assert sorted(tree.clear()) == sorted(set(match.block_ids) | {match.copy_block})
    assert tree.num_blocks == 0 and allocator.num_used == 0


def test_unlock_without_lock_raises_and_changes_nothing():
    tree, _ = tree_with(SYSTEM)
    match = tree.match(SYSTEM)
    tree.lock(match)
    tree.unlock(match)
    with pytest.raises(LockError):
        tree.unlock(match)
    assert tree.num_locked_blocks == 0 and tree.num_evictable_blocks == 3


def test_eviction_takes_the_least_recently_used_leaves_first():
    tree, _ = tree_with([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8])
    older = tree.match([1, 2, 3, 4, 5, 6, 7, 8])
    tree.lock(tree.match([9, 9, 9, 9]))  # the second sequence's first block: used now
    evicted = tree.evict(2)
    # The first sequence's leaf, then its parent (now a leaf, used before the second sequence).
    assert evicted == [older.block_ids[1], older.block_ids[0]]


def test_max_blocks_caps_the_tree_after_each_insert():
    tree, allocator = tree_with([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], max_blocks=3)
    assert tree.num_blocks == 3 and tree.num_evicted_blocks == 1
    assert tree.match([6, 7, 8, 9, 10]).num_tokens == 5  # the newest sequence is whole
    assert allocator.num_used == 3


def test_evict_idle_frees_what_was_not_used_for_the_ttl():
    now = [0.0]
    tree, _ = tree_with(clock=lambda: now[0])
    insert(tree, [1, 2, 3, 4], "a")
    now[0] = 100.0
    insert(tree, [5, 6, 7, 8], "b")
    now[0] = 130.0
    idle = list(tree.match([1, 2, 3, 4]).block_ids)
    assert tree.evict_idle(60.0) == idle
    assert tree.match([5, 6, 7, 8]).num_tokens == 4


def test_with_a_host_store_sessions_idle_past_the_ttl_leave_the_pool_for_the_store_and_stay():
    now = [0.0]
    slots = BlockAllocator(8)
    tree, allocator = tree_with(clock=lambda: now[0], slots=slots, store_min_tokens=0, idle_to_store=True)
    insert(tree, [1, 2, 3, 4, 9], "a")
    now[0] = 100.0
    insert(tree, [5, 6, 7, 8], "b")
    now[0] = 130.0
    idle = tree.match([1, 2, 3, 4, 9])
    freed = tree.evict_idle(60.0)
    # The idle session's blocks left the pool, the deepest first, into slots; nothing was evicted.
    assert sorted(freed) == sorted([*idle.block_ids, idle.copy_block])
    assert sorted(block for block, _ in tree.take_offloaded()) == sorted(freed)
    assert tree.num_evicted_blocks == 0 and tree.num_stored_blocks == 2 == slots.num_used
    assert tree.match([1, 2, 3, 4, 9]).num_matched == 5 and tree.match([5, 6, 7, 8]).num_cold == 0
    # Idle in the store for longer still: it stays, until the store needs its slots.
    now[0] = 1000.0
    tree.evict_idle(60.0)
    assert tree.match([1, 2, 3, 4, 9]).num_matched == 5 and tree.num_dropped_total == 0
    assert allocator.num_used == tree.num_blocks == 0


def test_entries_are_the_shared_system_prompt_and_each_conversation_after_it():
    now = [10.0]
    tree, _ = tree_with(clock=lambda: now[0])
    first = SYSTEM + [1, 2, 3]  # blocks: [100..103] [104..107] [108 109 1 2] [3]
    insert(tree, first, "a")
    now[0] = 20.0
    insert(tree, SYSTEM + [4, 5, 6], "b")  # parts from `first` inside the third block
    now[0] = 30.0
    second_turn = SYSTEM + [4, 5, 6, 7, 8]  # a later turn of b: the same run grows
    insert(tree, second_turn, "c")
    entry = {(e.start, e.num_tokens): e for e in tree.entries()}
    assert sorted(entry) == [(0, 8), (8, 5), (8, 7)]
    assert [entry[key].num_blocks for key in sorted(entry)] == [2, 2, 2]
    assert sum(e.num_blocks for e in entry.values()) == tree.num_blocks
    assert entry[0, 8].created_s == 10.0 and entry[8, 7].created_s == 20.0
    assert (entry[0, 8].last_used_s, entry[8, 5].last_used_s, entry[8, 7].last_used_s) == (30.0, 10.0, 30.0)
    assert all(e.hits == 0 and not e.in_use for e in entry.values())

    m = tree.match(SYSTEM + [9])  # same system prompt, another question: reads [108 109] of a branch
    tree.lock(m)
    tree.count_hit(m, m.num_tokens)
    hits = {(e.start, e.num_tokens): (e.hits, e.in_use) for e in tree.entries()}
    branch = (8, 5) if m.copy_block == tree.match(first).block_ids[2] else (8, 7)
    assert hits[0, 8] == (1, True) and hits[branch] == (1, True)
    assert sum(h for h, _ in hits.values()) == 2  # the trunk and the one branch it read

    tree.unlock(m)
    tree.evict(tree.num_blocks - 2)  # the branches go; their hit stays with the trunk
    assert [(e.start, e.num_tokens, e.hits) for e in tree.entries()] == [(0, 8, 1)]


def test_insert_of_a_free_block_raises_and_changes_nothing():
    tree, allocator = tree_with(SYSTEM)
    before = tree.block_ids()
    with pytest.raises(ValueError, match="free"):
        tree.insert(SYSTEM[:8] + [1, 2, 3, 4], [0, 1, 60])  # block 60 was never allocated
    assert tree.block_ids() == before and allocator.refcount(60) == 0


def test_sequences_under_different_salts_never_share():
    tree, allocator = tree_with()
    blocks = allocator.allocate(3, "a")
    tree.insert(SYSTEM, blocks, salt="tenant-a")
    allocator.free_owner("a")
    assert tree.match(SYSTEM, salt="tenant-b").kind is MatchKind.MISS
    assert tree.match(SYSTEM).kind is MatchKind.MISS  # no salt is a salt of its own
    assert tree.match(SYSTEM, salt="tenant-a").num_tokens == 10
    assert sorted(tree.clear()) == sorted(blocks) and allocator.num_used == 0


def test_a_sequence_inserted_without_its_end_is_no_prefix_of_anything():
    tree, allocator = tree_with()
    blocks = allocator.allocate(2, "running")
    tree.insert(SYSTEM[:8], blocks, end=False)  # the first blocks of a request still running
    match = tree.match(SYSTEM[:8] + [7])
    assert match.num_tokens == 8 and match.kind is MatchKind.LCP
    tree.insert(SYSTEM[:8], blocks)  # the request left: now its end is marked
    assert tree.match(SYSTEM[:8] + [7]).kind is MatchKind.PREFIX


def test_discard_takes_out_unlocked_leaves_last_first_and_keeps_what_is_locked():
    tree, allocator = tree_with(SYSTEM[:4])
    blocks = allocator.allocate(3, "failed")
    taken = tree.insert(SYSTEM[:4] + [1, 2, 3, 4, 5, 6, 7, 8], blocks[:3], end=False)
    assert taken == blocks[1:3]
    other = tree.match(SYSTEM[:4] + [1, 2, 3, 4, 0])  # someone reuses the first given block
    tree.lock(other)
    assert tree.discard(taken) == [blocks[2]]
    assert blocks[1] in tree.block_ids() and allocator.refcount(blocks[2]) == 1  # the request's own
    tree.unlock(other)
    assert tree.discard(taken) == [blocks[1]]
    assert tree.block_ids() == [tree.match(SYSTEM[:4]).block_ids[0]]


LONG = list(range(200, 212))  # 12 tokens: three full blocks


def cold_tree(*sequences, num_blocks=16, num_slots=8, min_tokens=8):
    """A tree with an int8 store of `num_slots` slots, for sequences of `min_tokens` or more."""
    slots = BlockAllocator(num_slots)
    tree, allocator = tree_with(*sequences, num_blocks=num_blocks, slots=slots, store_min_tokens=min_tokens)
    return tree, allocator, slots


def test_evict_moves_cold_blocks_of_long_sequences_to_int8_before_evicting_anything():
    tree, allocator, slots = cold_tree(LONG, [1, 2, 3, 4])  # the short one is below min_tokens
    blocks = list(tree.match(LONG).block_ids)
    freed = tree.evict(2)
    # The least recently used blocks that qualify (the long sequence's, the deepest first) went
    # int8; nothing was evicted: the tree still matches every token.
    assert freed == blocks[:0:-1] and tree.num_evicted_blocks == 0
    assert [block for block, _ in tree.take_offloaded()] == freed and tree.take_offloaded() == []
    assert tree.num_blocks == 2 and tree.num_stored_blocks == 2 == slots.num_used
    assert allocator.num_used == 2
    match = tree.match(LONG)
    assert match.num_matched == 12 and match.num_cold == 2
    # The short sequence never goes int8: once the long one's last block is, it is evicted.
    (short_block,) = tree.match([1, 2, 3, 4]).block_ids
    assert tree.evict(2) == [blocks[0], short_block]
    assert tree.num_evicted_blocks == 1 and tree.num_stored_blocks == 3 and allocator.num_used == 0


def test_warm_restores_int8_blocks_into_the_given_blocks_and_frees_their_slots():
    tree, allocator, slots = cold_tree(LONG)
    tree.evict(3)
    quantized_slots = {slot for _, slot in tree.take_offloaded()}
    match = tree.match(LONG + [0])
    assert match.num_cold == 3 and match.num_tokens == 12
    tree.lock(match)
    assert tree.num_locked_blocks == 0  # int8 nodes are locked but hold no block
    new_blocks = allocator.allocate(3, tree.owner)
    warmed, restores = tree.warm(match, new_blocks)
    assert warmed.block_ids == tuple(new_blocks) and warmed.num_cold == 0
    assert {slot for slot, _ in restores} == quantized_slots and slots.num_used == 0
    assert [block for _, block in restores] == new_blocks
    assert tree.match(LONG).block_ids == tuple(new_blocks)
    assert tree.num_locked_blocks == 3 and tree.num_evictable_blocks == 0
    tree.unlock(warmed)
    assert tree.num_evictable_blocks == 3


def test_full_slots_take_the_least_recently_used_int8_leaf_to_make_room():
    tree, allocator, slots = cold_tree(LONG, num_slots=2)
    blocks = list(tree.match(LONG).block_ids)
    tree.evict(2)  # LONG's last two blocks go int8: the slots are full
    insert(tree, list(range(300, 308)), "other")
    # LONG's first block is the least recently used: the oldest int8 leaf (LONG's last block)
    # makes room for it, so it goes int8 instead of being evicted.
    assert tree.evict(1) == [blocks[0]]
    assert tree.num_stored_blocks == 2 and tree.num_evicted_blocks == 0
    assert tree.match(LONG).num_matched == 8


def test_eviction_goes_through_int8_leaves_to_free_blocks():
    tree, allocator, slots = cold_tree(LONG, num_slots=1, min_tokens=100)
    # Nothing qualifies for int8: plain eviction, and the slots stay unused.
    assert len(tree.evict(3)) == 3 and slots.num_used == 0 and allocator.num_used == 0
    tree, allocator, slots = cold_tree(LONG, num_slots=1)
    blocks = list(tree.match(LONG).block_ids)
    tree.evict(1)  # the last block goes int8: a leaf in a slot, in the way of its parent
    assert sorted(tree.clear()) == sorted(blocks[:2])
    assert tree.num_blocks == tree.num_stored_blocks == 0
    assert slots.num_used == 0 and allocator.num_used == 0
