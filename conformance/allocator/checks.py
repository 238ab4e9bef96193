"""Checks for specs/allocator: random allocator call sequences against a plain-dict model.

Every check runs the same hypothesis state machine (random valid calls in any order, mixed with
the misuse its clause is about) and asserts only its own clause, so a broken allocator fails the
clauses it breaks and no others. The model is a dict {owner: blocks in the order it got them};
a block's refcount is the number of owners whose list holds it. For PagedKVPool the machine
drives `pool.allocator`.
"""

from collections.abc import Callable

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from conformance.allocator.stores import store_round_trips  # noqa: F401  (ALLOC-017)
from conformance.state_machines import run_machine
from infer.cache import (
    BlockAllocator,
    CacheError,
    CacheFullError,
    DoubleFreeError,
    ForeignBlockError,
    KVCacheShape,
    OwnerError,
    PagedKVPool,
    UnallocatedBlockError,
)

# The smallest real tensors: the checks are about bookkeeping, the layout has its own unit tests.
TINY_SHAPE = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, block_size=2)
# implementation name (applies_to) -> num_blocks -> the allocator under test.
ALLOCATORS: dict[str, Callable[[int], object]] = {
    "BlockAllocator": BlockAllocator,
    "PagedKVPool": lambda num_blocks: PagedKVPool(TINY_SHAPE, num_blocks).allocator,
}
# implementation name -> num_blocks -> a whole pool, for the pool's own clauses.
KV_POOLS: dict[str, Callable[[int], object]] = {
    "PagedKVPool": lambda num_blocks: PagedKVPool(TINY_SHAPE, num_blocks),
}
POOL_CLAUSES = {"null_block_never_handed_out"}
DOUBLE_FREE_CLAUSES = ("double_free_raises", "refcount_never_negative")
OWNERS = ["req-0", "req-1", "req-2"]
FOREIGN_IDS = st.one_of(st.integers(max_value=-1), st.integers(min_value=10**6), st.just("0"), st.none())


def conservation(case: dict, impl: str) -> None:
    _run(case, impl, "conservation")


def unique_ownership(case: dict, impl: str) -> None:
    _run(case, impl, "unique_ownership")


def full_pool_raises(case: dict, impl: str) -> None:
    _run(case, impl, "full_pool_raises")


def double_free_raises(case: dict, impl: str) -> None:
    _run(case, impl, "double_free_raises")


def foreign_block_raises(case: dict, impl: str) -> None:
    _run(case, impl, "foreign_block_raises")


def owner_tracking(case: dict, impl: str) -> None:
    _run(case, impl, "owner_tracking")


def audit_finds_leaks(case: dict, impl: str) -> None:
    _run(case, impl, "audit_finds_leaks")


def usage_ratio(case: dict, impl: str) -> None:
    _run(case, impl, "usage_ratio")


def refcount_never_negative(case: dict, impl: str) -> None:
    _run(case, impl, "refcount_never_negative")


def no_reuse_while_referenced(case: dict, impl: str) -> None:
    _run(case, impl, "no_reuse_while_referenced")


def fork_shares_blocks(case: dict, impl: str) -> None:
    _run(case, impl, "fork_shares_blocks")


def free_owner_returns_all(case: dict, impl: str) -> None:
    _run(case, impl, "free_owner_returns_all")


def share_free_block_raises(case: dict, impl: str) -> None:
    _run(case, impl, "share_free_block_raises")


def null_block_never_handed_out(case: dict, impl: str) -> None:
    _run(case, impl, "null_block_never_handed_out")


def blocks_per_sequence(case: dict, impl: str) -> None:
    """Grows one sequence a token at a time through the engine's KVCacheManager over `impl`."""
    from infer.engine.kv_manager import KVCacheManager
    from infer.engine.request import Request
    from infer.engine.sampling_params import SamplingParams

    block_size = case["block_size"]
    for num_tokens in case["token_counts"]:
        allocator = ALLOCATORS[impl](-(-num_tokens // block_size))
        kv_manager = KVCacheManager(allocator, block_size)
        request = Request("seq", [0], SamplingParams())
        for position in range(num_tokens):
            new_blocks = kv_manager.allocate(request, 1)
            at_boundary = position % block_size == 0
            assert bool(new_blocks) == at_boundary, (
                f"token {position} (block_size {block_size}) got new blocks {new_blocks}; a block "
                "must be taken exactly at a block boundary"
            )
            request.num_computed_tokens += 1
        expected = -(-num_tokens // block_size)
        block_ids = list(kv_manager.block_ids("seq"))
        assert len(block_ids) == expected, (
            f"{num_tokens} tokens hold {len(block_ids)} blocks, expected ceil(n / block_size) = {expected}"
        )
        assert allocator.owned_by("seq") == block_ids and allocator.num_free == 0


def _run(case: dict, impl: str, clause: str) -> None:
    factories = KV_POOLS if clause in POOL_CLAUSES else ALLOCATORS
    if impl not in factories:
        raise ValueError(
            f"no factory for implementation {impl!r}; add it to ALLOCATORS or KV_POOLS in {__file__}"
        )
    machine = _machine_for(factories[impl], case["num_blocks"], clause)
    run_machine(machine, case)


def _machine_for(make: Callable[[int], object], num_blocks: int, clause: str) -> type:
    class AllocatorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.pool = make(num_blocks) if clause in POOL_CLAUSES else None
            self.allocator = self.pool.allocator if self.pool is not None else make(num_blocks)
            self.held: dict[str, list[int]] = {owner: [] for owner in OWNERS}  # the model

        def checking(self, name: str) -> bool:
            return clause == name

        def checking_any(self, *names: str) -> bool:
            return clause in names

        def model_refcount(self, block: int) -> int:
            return sum(block in blocks for blocks in self.held.values())

        def model_free(self) -> list[int]:
            return [b for b in range(num_blocks) if self.model_refcount(b) == 0]

        def snapshot(self):
            alloc, ids = self.allocator, range(num_blocks)
            return (
                alloc.num_free,
                alloc.num_used,
                [alloc.refcount(b) for b in ids],
                [alloc.owners_of(b) for b in ids],
                [alloc.owned_by(o) for o in OWNERS],
            )

        # Rules whose preconditions fail are not drawn, so every step does something. Valid calls
        # run under every clause; each kind of misuse only under the clause that judges it.
        def holders(self) -> list[str]:
            return [owner for owner in OWNERS if self.held[owner]]

        @rule(num=st.integers(min_value=0, max_value=num_blocks + 1), owner=st.sampled_from(OWNERS))
        def allocate(self, num, owner):
            if num > len(self.model_free()):
                if self.checking("full_pool_raises"):
                    call = lambda: self.allocator.allocate(num, owner)
                    self.expect_refusal(call, CacheFullError, f"allocate({num}, {owner!r})")
                return
            self.take(num, owner)

        @precondition(lambda self: self.model_free())
        @rule(owner=st.sampled_from(OWNERS))
        def drain(self, owner):
            self.take(len(self.model_free()), owner)

        def take(self, num, owner):
            referenced = {b for blocks in self.held.values() for b in blocks}
            blocks = self.allocator.allocate(num, owner)
            if self.checking("unique_ownership"):
                assert len(blocks) == num, f"allocate({num}) returned {len(blocks)} blocks: {blocks}"
                assert len(set(blocks)) == num, f"allocate({num}) returned a block twice: {blocks}"
                assert all(0 <= b < num_blocks for b in blocks), f"{blocks} not all in 0..{num_blocks - 1}"
            if self.checking("unique_ownership") or self.checking("no_reuse_while_referenced"):
                reused = sorted(set(blocks) & referenced)
                assert not reused, f"allocate handed {owner!r} blocks {reused}, which are still referenced"
            if self.checking("null_block_never_handed_out"):
                null = self.pool.null_block
                assert null not in blocks, f"allocate({num}) handed out the null block {null}: {blocks}"
            self.held[owner] += blocks

        @precondition(lambda self: self.holders())
        @rule(child=st.sampled_from(OWNERS), data=st.data())
        def share(self, child, data):
            parent = data.draw(st.sampled_from(self.holders()), label="parent")
            blocks = [b for b in self.held[parent] if b not in self.held[child]]
            before = [self.allocator.refcount(b) for b in blocks], self.allocator.num_free
            self.allocator.share(blocks, child)
            if self.checking("fork_shares_blocks"):
                after = [self.allocator.refcount(b) for b in blocks], self.allocator.num_free
                expected = [n + 1 for n in before[0]], before[1]
                assert after == expected, (
                    f"share({blocks}, {child!r}): (refcounts, num_free) {after}, expected {expected}"
                )
            self.held[child] += blocks

        @precondition(lambda self: self.checking("share_free_block_raises") and self.model_free())
        @rule(owner=st.sampled_from(OWNERS), data=st.data())
        def share_a_free_block(self, owner, data):
            others = {b for o, blocks in self.held.items() if o != owner for b in blocks} - set(
                self.held[owner]
            )
            free_block = data.draw(st.sampled_from(self.model_free()), label="free block")
            blocks = data.draw(st.permutations([free_block, *sorted(others)]), label="blocks")
            call = lambda: self.allocator.share(blocks, owner)
            self.expect_refusal(call, UnallocatedBlockError, f"share({blocks})")

        @precondition(lambda self: self.holders())
        @rule(data=st.data())
        def free_some(self, data):
            owner = data.draw(st.sampled_from(self.holders()), label="owner")
            blocks = data.draw(
                st.lists(st.sampled_from(self.held[owner]), min_size=1, unique=True), label="blocks"
            )
            before = [self.allocator.refcount(b) for b in blocks]
            self.allocator.free(blocks, owner)
            if self.checking("refcount_never_negative"):
                after = [self.allocator.refcount(b) for b in blocks]
                assert after == [n - 1 for n in before], f"free({blocks}): refcounts {before} -> {after}"
            self.held[owner] = [b for b in self.held[owner] if b not in blocks]

        @precondition(lambda self: self.checking_any(*DOUBLE_FREE_CLAUSES) and self.model_free())
        @rule(owner=st.sampled_from(OWNERS), data=st.data())
        def free_with_a_free_block(self, owner, data):
            free_block = data.draw(st.sampled_from(self.model_free()), label="free block")
            blocks = data.draw(st.permutations([free_block, *self.held[owner]]), label="blocks")
            call = lambda: self.allocator.free(blocks, owner)
            what = f"free({blocks}, {owner!r}) with block {free_block} free"
            # ALLOC-009 asks only that it raises; ALLOC-004 names the error.
            self.expect_refusal(
                call, DoubleFreeError if self.checking("double_free_raises") else CacheError, what
            )

        @precondition(lambda self: self.checking("owner_tracking") and self.holders())
        @rule(owner=st.sampled_from(OWNERS), data=st.data())
        def free_a_block_of_others(self, owner, data):
            others = sorted({b for blocks in self.held.values() for b in blocks} - set(self.held[owner]))
            if not others:
                return
            block = data.draw(st.sampled_from(others), label="block")
            call = lambda: self.allocator.free([*self.held[owner], block], owner)
            what = f"free of block {block} by {owner!r}, which does not hold it"
            self.expect_refusal(call, OwnerError, what)

        @precondition(lambda self: self.checking("foreign_block_raises"))
        @rule(
            owner=st.sampled_from(OWNERS), block=FOREIGN_IDS, call=st.sampled_from(["free", "share", "query"])
        )
        def use_a_foreign_id(self, owner, block, call):
            calls = {
                "free": lambda: self.allocator.free([*self.held[owner], block], owner),
                "share": lambda: self.allocator.share([block], owner),
                "query": lambda: (self.allocator.refcount(block), self.allocator.owners_of(block)),
            }
            what = f"{call} with foreign id {block!r}"
            self.expect_refusal(calls[call], ForeignBlockError, what)

        @precondition(lambda self: self.holders())
        @rule(data=st.data())
        def free_owner(self, data):
            owner = data.draw(st.sampled_from(self.holders()), label="owner")
            released = self.allocator.free_owner(owner)
            if self.checking("free_owner_returns_all"):
                assert list(released) == self.held[owner], (
                    f"free_owner({owner!r}) returned {released}, the owner held {self.held[owner]}"
                )
                left = self.allocator.owned_by(owner)
                assert left == [], f"after free_owner({owner!r}) it still holds {left}"
            self.held[owner] = []

        @precondition(lambda self: self.checking("audit_finds_leaks"))
        @rule(live=st.sets(st.sampled_from(OWNERS)))
        def audit(self, live):
            before = self.snapshot() if self.checking("audit_finds_leaks") else None
            leaks = self.allocator.audit(live)
            if self.checking("audit_finds_leaks"):
                expected = self.leaks(live)
                assert list(leaks) == expected, f"audit(live={sorted(live)}) = {leaks}, expected {expected}"
                assert self.snapshot() == before, f"audit(live={sorted(live)}) changed the allocator"

        @precondition(lambda self: self.holders())
        @rule(live=st.sets(st.sampled_from(OWNERS)))
        def reclaim(self, live):
            expected = self.leaks(live)
            reclaimed = self.allocator.reclaim(live)
            if self.checking("audit_finds_leaks"):
                assert list(reclaimed) == expected, (
                    f"reclaim(live={sorted(live)}) = {reclaimed}, expected {expected}"
                )
            for owner in OWNERS:
                if owner not in live:
                    self.held[owner] = []

        def leaks(self, live) -> list[int]:
            return sorted({b for owner, blocks in self.held.items() if owner not in live for b in blocks})

        @invariant()
        def after_every_step(self):
            alloc, ids = self.allocator, range(num_blocks)
            num_held = num_blocks - len(self.model_free())
            if self.checking("conservation"):
                assert alloc.num_free + alloc.num_used == alloc.num_blocks == num_blocks, (
                    f"num_free {alloc.num_free} + num_used {alloc.num_used} != num_blocks {num_blocks}"
                )
                assert alloc.num_used == num_held, f"num_used {alloc.num_used}, {num_held} blocks held"
            if self.checking("owner_tracking"):
                owners = {b: alloc.owners_of(b) for b in ids}
                expected = {b: sorted(o for o, blocks in self.held.items() if b in blocks) for b in ids}
                assert owners == expected, f"owners_of per block {owners}, expected {expected}"
                owned = {o: alloc.owned_by(o) for o in OWNERS}
                assert owned == self.held, f"owned_by per owner {owned}, expected {self.held}"
            if self.checking("usage_ratio"):
                assert alloc.usage_ratio == num_held / num_blocks, (
                    f"usage_ratio {alloc.usage_ratio} with {num_held} of {num_blocks} held"
                )
            if self.checking("refcount_never_negative"):
                refcounts = [alloc.refcount(b) for b in ids]
                expected = [self.model_refcount(b) for b in ids]
                assert refcounts == expected, f"refcount per block {refcounts}, expected {expected}"
            if self.checking("fork_shares_blocks"):
                for owner, blocks in self.held.items():
                    kept = alloc.owned_by(owner)
                    assert kept == blocks, (
                        f"after frees of other owners {owner!r} holds {kept}, expected {blocks}"
                    )
                    assert all(alloc.refcount(b) > 0 for b in blocks), (
                        f"after frees of other owners {owner!r}'s blocks {blocks} went free"
                    )
            if self.checking("no_reuse_while_referenced"):
                # Drain what the allocator calls free and give it back: a held block must not be in it.
                probe = alloc.allocate(alloc.num_free, "probe")
                referenced = sorted({b for blocks in self.held.values() for b in blocks} & set(probe))
                assert not referenced, (
                    f"allocate handed the probe blocks {referenced}, which are still referenced"
                )
                alloc.free(probe, "probe")
            if self.checking("null_block_never_handed_out"):
                pool = self.pool
                assert pool.null_block == pool.num_blocks == alloc.num_blocks == num_blocks, (
                    f"null_block {pool.null_block}, num_blocks {pool.num_blocks}, "
                    f"allocator.num_blocks {alloc.num_blocks}, expected all {num_blocks}"
                )
                rows = {tuple(t.shape[:1]) for layer in pool.kv_layers for t in layer}
                assert rows == {(num_blocks + 1,)}, (
                    f"K/V tensors have {rows} blocks, expected {num_blocks + 1}"
                )

        def expect_refusal(self, call, error: type[Exception], what: str) -> None:
            before = self.snapshot()
            try:
                call()
            except error:
                pass
            except Exception as other:  # noqa: BLE001 - a wrong error type fails the clause, named
                raise AssertionError(f"{what} raised {other!r}, expected {error.__name__}") from other
            else:
                raise AssertionError(f"{what} did not raise {error.__name__}")
            assert self.snapshot() == before, f"a refused {what} changed the allocator"

    AllocatorMachine.__name__ = f"{clause}_machine"
    return AllocatorMachine
