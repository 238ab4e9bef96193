"""The scheduler checks with the prefix cache on (the `-prefix-cache` variants): the prompts give
the cache hits of every kind, and each broken cache below fails its clause's check on that
clause's own case from specs/scheduler, where the real KVCacheManager and Scheduler pass."""

import pytest
import yaml

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from infer.cache import COPY, MatchKind
from infer.engine.request import RequestState
from infer.engine.scheduler import Scheduler

checks = load_checks_module(CHECKS_DIR, "scheduler")
SPEC = yaml.safe_load((CHECKS_DIR.parent / "specs" / "scheduler" / "scheduling.yaml").read_text())
CACHED = "fcfs" + checks.PREFIX_CACHE_SUFFIX


def spec_case(clause_id: str, case_id: str) -> dict:
    clause = next(c for c in SPEC["clauses"] if c["id"] == clause_id)
    return {**SPEC["defaults"], **next(c for c in clause["cases"] if c["id"] == case_id)}


def test_every_variant_named_in_the_spec_is_one_the_checks_run():
    from infer.engine.scheduling_policy import POLICIES

    assert set(SPEC["applies_to"]) <= set(checks.impl_names(POLICIES))
    assert any(impl.endswith(checks.PREFIX_CACHE_SUFFIX) for impl in SPEC["applies_to"])


def test_prompts_give_the_cache_misses_and_hits_of_every_kind():
    case = spec_case("SCHED-007", "random-load")
    sim = checks.simulate(case, CACHED)
    assert sim.prefix_tree is not None
    assert {kind.value for kind in MatchKind} <= {kind for kind, n in sim.match_counts.items() if n > 0}
    assert any(op[0] == COPY for decision in sim.decisions for op in decision.block_ops)
    admitted_with_cached_tokens = [
        new for decision in sim.decisions for new in decision.new_requests if new.num_computed_tokens
    ]
    assert admitted_with_cached_tokens


def test_the_same_prompts_run_with_the_cache_off():
    case = spec_case("SCHED-007", "random-load")
    plain, cached = checks.simulate(case, "fcfs"), checks.simulate(case, CACHED)
    assert plain.prefix_tree is None and not plain.match_counts
    assert [a.prompt_token_ids for a in plain.arrivals] == [a.prompt_token_ids for a in cached.arrivals]
    first_prompts = {new.request_id: new.token_ids for d in plain.decisions for new in d.new_requests}
    assert first_prompts["r0"] == plain.arrival("r0").prompt_token_ids


# -- broken caches ----------------------------------------------------------------------------


class _WithKVCacheManager(Scheduler):
    """The real Scheduler over the same pool and tree, with `kv_cache_manager_class` (a
    RecordingKVCacheManager with a bug) in place of the real manager."""

    kv_cache_manager_class = checks.RecordingKVCacheManager

    def __init__(self, *, kv_manager, **kwargs):
        replaced = self.kv_cache_manager_class(
            kv_manager.allocator, kv_manager.block_size, kv_manager.prefix_tree
        )
        super().__init__(kv_manager=replaced, **kwargs)


class PreemptsBeforeEvicting(Scheduler):
    """Makes room by preemption while the free list alone is short, as if the blocks only the
    prefix cache holds were not there (it reads allocator.num_free, not kv_manager.num_free_blocks)."""

    def _serve(self, request, plan):
        if request.request_id not in plan.num_scheduled_tokens and request in self._running:
            num_tokens = self._num_tokens_to_schedule(request, plan)
            while num_tokens and self.kv_manager.num_new_blocks(request, num_tokens) > (
                self.kv_manager.allocator.num_free
            ):
                victim = self._preemption_victim(request, plan)
                if victim is None or victim is request:
                    break
                self._preempt(victim, plan)
        super()._serve(request, plan)


class _LateEvictingKVCacheManager(checks.RecordingKVCacheManager):
    """Refuses a running request the blocks the free list lacks, and evicts them for the retry,
    after someone was preempted. (Admissions are served as the real one does: the scheduler
    allocates for them only once num_free_blocks said there was room.)"""

    _refuse_first = False

    def allocate(self, request, num_new_tokens, num_lookahead_tokens=0):
        self._refuse_first = request.state is RequestState.RUNNING
        try:
            return super().allocate(request, num_new_tokens, num_lookahead_tokens)
        finally:
            self._refuse_first = False

    def _take(self, num_blocks, owner):
        short = num_blocks - self.allocator.num_free
        if self._refuse_first and short > 0:
            self.prefix_tree.evict(short)
            return None
        return super()._take(num_blocks, owner)


class EvictsOnlyAfterRefusing(_WithKVCacheManager):
    kv_cache_manager_class = _LateEvictingKVCacheManager


class _CopylessKVCacheManager(checks.RecordingKVCacheManager):
    def take_block_ops(self):
        return tuple(op for op in super().take_block_ops() if op[0] != COPY)


class SkipsCopyOnWrite(_WithKVCacheManager):
    """Gives a request the block its match ends inside without copying the cached tokens into it."""

    kv_cache_manager_class = _CopylessKVCacheManager


class _SharingKVCacheManager(checks.RecordingKVCacheManager):
    """Shares the cached block a match ends inside instead of copying it, and writes the request's
    own tokens there (the tree would refuse such a request's blocks, so it gives the tree none)."""

    def __init__(self, allocator, block_size, prefix_tree=None):
        super().__init__(allocator, block_size, prefix_tree)
        self._sharing: set[str] = set()

    def acquire(self, request, match):
        num_reused = super().acquire(request, match)
        blocks = self._blocks.get(request.request_id, [])
        copies = [op for op in self._ops if op[0] == COPY and op[2] in blocks]
        for _, source, target in copies:
            self._ops.remove((COPY, source, target))
            self.allocator.free([target], request.request_id)
            self.allocator.share([source], request.request_id)
            blocks[blocks.index(target)] = source
            self._sharing.add(request.request_id)
        return num_reused

    def cache_computed(self, request):
        if request.request_id not in self._sharing:
            super().cache_computed(request)

    def free(self, request, *, cache=True):
        sharing = request.request_id in self._sharing
        self._sharing.discard(request.request_id)
        super().free(request, cache=cache and not sharing)


class SharesInsteadOfCopying(_WithKVCacheManager):
    kv_cache_manager_class = _SharingKVCacheManager


class _LockKeepingKVCacheManager(checks.RecordingKVCacheManager):
    def free(self, request, *, cache=True):
        self._matches.pop(request.request_id, None)  # forgets to unlock what it reused or gave
        super().free(request, cache=cache)


class KeepsLocksOnFinish(_WithKVCacheManager):
    kv_cache_manager_class = _LockKeepingKVCacheManager


BROKEN = [
    ("SCHED-012", "cached-blocks-make-room", PreemptsBeforeEvicting, checks.assert_evicts_before_preempting,
     "without a refused allocate"),
    ("SCHED-012", "many-preemptions", EvictsOnlyAfterRefusing, checks.assert_evicts_before_preempting,
     "evict the cache's blocks before refusing"),
    ("SCHED-013", "small-blocks", SkipsCopyOnWrite, checks.assert_reads_own_tokens, "not its own"),
    ("SCHED-013", "small-blocks", SharesInsteadOfCopying, checks.assert_reads_own_tokens, "not its own"),
    ("SCHED-004", "random-load-small-pool", SharesInsteadOfCopying, checks.assert_kv_budget,
     "shared blocks are read only"),
    ("SCHED-006", "length-and-eos", KeepsLocksOnFinish, checks.assert_retire_frees_everything,
     "still locked after the last retire"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("clause_id", "case_id", "broken", "assertion", "reason"),
    BROKEN,
    ids=[f"{row[0]}-{row[2].__name__}" for row in BROKEN],
)
def test_check_fails_a_broken_cache_and_passes_the_real_one(clause_id, case_id, broken, assertion, reason):
    case = spec_case(clause_id, case_id)
    assertion(checks.simulate(case, CACHED))
    sim = checks.simulate(case, CACHED, scheduler_class=broken)  # it runs to the end: no livelock
    with pytest.raises(AssertionError, match=reason):
        assertion(sim)


def test_a_case_that_never_evicts_fails_expect_eviction():
    case = {**spec_case("SCHED-012", "cached-blocks-make-room"), "kv_blocks": 64}
    with pytest.raises(AssertionError, match="does not exercise eviction"):
        checks.assert_evicts_before_preempting(checks.simulate(case, CACHED))
