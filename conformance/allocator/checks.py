"""Checks for specs/allocator: random alloc/free/audit sequences against a brute-force model.

Every check runs the same hypothesis state machine (any mix of valid and invalid calls, in any
order) and asserts only its own clause after every step, so a broken pool fails the clauses it
breaks and no others. The oracle is a plain dict {block id: owner} updated by the rules.
"""

import contextlib
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from infer.cache import (
    CacheError,
    CacheFullError,
    DoubleFreeError,
    ForeignBlockError,
    KVCacheShape,
    SlotAllocator,
    SlottedKVCache,
)

# The smallest real tensors: the checks are about bookkeeping, the layout has its own unit tests.
TINY_SHAPE = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=2, max_seq_len=2, dtype=torch.float32)
POOLS: dict[str, Callable[[int], object]] = {
    "SlotAllocator": SlotAllocator,
    "SlottedKVCache": lambda capacity: SlottedKVCache(TINY_SHAPE, num_slots=capacity),
}
OWNERS = ["req-0", "req-1", "req-2", "req-3"]


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


def _run(case: dict, impl: str, clause: str) -> None:
    if impl not in POOLS:
        raise ValueError(f"no pool factory for implementation {impl!r}; add it to POOLS in {__file__}")
    machine = _machine_for(POOLS[impl], case["capacity"], clause)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=case["max_examples"],
            stateful_step_count=case["steps"],
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def _machine_for(make_pool: Callable[[int], object], capacity: int, clause: str) -> type:
    class PoolMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.pool = make_pool(capacity)
            self.owners: dict[int, str] = {}  # the oracle: block id -> owner

        def checking(self, name: str) -> bool:
            return clause == name

        def snapshot(self):
            return self.pool.num_free, self.pool.num_used, [self.pool.owner_of(i) for i in range(capacity)]

        @rule(owner=st.sampled_from(OWNERS))
        def allocate(self, owner):
            if len(self.owners) == capacity:
                if self.checking("full_pool_raises"):
                    before = self.snapshot()
                    try:
                        self.pool.allocate(owner)
                    except CacheFullError:
                        pass
                    else:
                        raise AssertionError(
                            f"allocate({owner!r}) on a full pool of {capacity} did not raise"
                        )
                    assert self.snapshot() == before, "a refused allocate changed the pool"
                else:
                    with contextlib.suppress(CacheError):
                        self.pool.allocate(owner)
                return
            block = self.pool.allocate(owner)
            if self.checking("unique_ownership"):
                assert 0 <= block < capacity, f"allocate returned {block}, outside 0..{capacity - 1}"
                assert block not in self.owners, (
                    f"block {block} handed to {owner!r} is owned by {self.owners[block]!r}"
                )
            self.owners[block] = owner

        @rule(data=st.data())
        def free_owned(self, data):
            if not self.owners:
                return
            block = data.draw(st.sampled_from(sorted(self.owners)))
            self.pool.free(block)
            del self.owners[block]

        @rule(data=st.data())
        def free_a_free_block(self, data):
            free_blocks = [b for b in range(capacity) if b not in self.owners]
            if not free_blocks:
                return
            block = data.draw(st.sampled_from(free_blocks))
            self._expect_refusal(lambda: self.pool.free(block), DoubleFreeError, "double_free_raises", block)

        @rule(
            block=st.one_of(
                st.integers(max_value=-1), st.integers(min_value=capacity), st.just("0"), st.none()
            )
        )
        def free_foreign(self, block):
            self._expect_refusal(
                lambda: self.pool.free(block), ForeignBlockError, "foreign_block_raises", block
            )

        @rule(live=st.sets(st.sampled_from(OWNERS)))
        def audit(self, live):
            leaks = self.pool.audit(live)
            if self.checking("audit_finds_leaks"):
                expected = sorted(b for b, owner in self.owners.items() if owner not in live)
                assert list(leaks) == expected, f"audit(live={sorted(live)}) = {leaks}, expected {expected}"

        @invariant()
        def after_every_step(self):
            pool = self.pool
            if self.checking("conservation"):
                assert pool.num_free + pool.num_used == pool.capacity == capacity, (
                    f"num_free {pool.num_free} + num_used {pool.num_used} != capacity {capacity}"
                )
                assert pool.num_used == len(self.owners), (
                    f"num_used {pool.num_used}, {len(self.owners)} owned"
                )
            if self.checking("owner_tracking"):
                actual = {b: pool.owner_of(b) for b in range(capacity)}
                expected = {b: self.owners.get(b) for b in range(capacity)}
                assert actual == expected, f"owner_of per block {actual}, expected {expected}"
            if self.checking("usage_ratio"):
                assert pool.usage_ratio == len(self.owners) / capacity, (
                    f"usage_ratio {pool.usage_ratio} with {len(self.owners)} of {capacity} used"
                )

        def _expect_refusal(self, call, error: type[Exception], name: str, block) -> None:
            if not self.checking(name):
                with contextlib.suppress(CacheError):
                    call()
                return
            before = self.snapshot()
            try:
                call()
            except error:
                pass
            else:
                raise AssertionError(f"free({block!r}) did not raise {error.__name__}")
            assert self.snapshot() == before, f"a refused free({block!r}) changed the pool"

    PoolMachine.__name__ = f"{clause}_machine"
    return PoolMachine
