"""The scheduler checks catch real bugs: each broken scheduler below fails its own clause's check
on that clause's own case from specs/scheduler, where the real Scheduler passes."""

import dataclasses

import pytest
import yaml

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from infer.engine.kv_manager import KVCacheManager
from infer.engine.scheduler import Scheduler

checks = load_checks_module(CHECKS_DIR, "scheduler")
SPEC = yaml.safe_load((CHECKS_DIR.parent / "specs" / "scheduler" / "scheduling.yaml").read_text())


def spec_case(clause_id: str, case_id: str) -> dict:
    clause = next(c for c in SPEC["clauses"] if c["id"] == clause_id)
    return {**SPEC["defaults"], **next(c for c in clause["cases"] if c["id"] == case_id)}


class AdmitsShortestFirst(Scheduler):
    """Lets a small request overtake a large one that waits for KV room."""

    def _admit(self, plan):
        self._waiting = type(self._waiting)(sorted(self._waiting, key=lambda r: r.num_prompt_tokens))
        super()._admit(plan)


class NeverForcesDecodes(Scheduler):
    def _due_decoders(self, step):
        return []


class LeaksOnFinish(Scheduler):
    def finish(self, request_id, *, cache=True):
        self.kv_manager._blocks.pop(request_id, None)  # forgets its blocks instead of freeing them
        return super().finish(request_id, cache=cache)


class ReportsFinishedTwice(Scheduler):
    def schedule(self):
        decision = super().schedule()
        self._finished_ids |= decision.finished_request_ids
        return decision


class OverspendsTokens(Scheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.max_num_batched_tokens += 8


class _ReservingKVCacheManager(KVCacheManager):
    def num_new_blocks(self, request, num_new_tokens, num_lookahead_tokens=0):
        # Everything the request may ever need, as the slotted scheduler reserved at admission.
        whole = (
            request.num_prompt_tokens + request.max_new_tokens - request.num_computed_tokens - num_new_tokens
        )
        return super().num_new_blocks(request, num_new_tokens, max(num_lookahead_tokens, whole))


class ReservesWholeRequest(Scheduler):
    def __init__(self, *, kv_manager, **kwargs):
        reserving = _ReservingKVCacheManager(kv_manager.allocator, kv_manager.block_size)
        super().__init__(kv_manager=reserving, **kwargs)


class AcceptsAnything(Scheduler):
    def check_fits(self, num_prompt_tokens, max_new_tokens):
        pass


class PreemptsOldest(Scheduler):
    def _preemption_victim(self, request, plan):
        for candidate in self._running:
            holds_blocks = bool(self.kv_manager.block_ids(candidate.request_id))
            if holds_blocks and candidate.request_id not in plan.num_scheduled_tokens:
                return candidate
        return None


class RequeuesPreemptedLast(Scheduler):
    def _preempt(self, request, plan):
        super()._preempt(request, plan)
        self._waiting.remove(request)
        self._waiting.append(request)


class ResumesWithPromptOnly(Scheduler):
    """Forgets a preempted request's outputs: it would recompute from its prompt alone."""

    def _decision(self, plan):
        decision = super()._decision(plan)
        new_requests = tuple(
            dataclasses.replace(new, token_ids=new.token_ids[: new.num_prompt_tokens])
            for new in decision.new_requests
        )
        return dataclasses.replace(decision, new_requests=new_requests)


class IgnoresChunkSize(Scheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prefill_chunk_size = 10_000


class ChunksAnyway(Scheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.use_chunked_prefill = True
        self.prefill_chunk_size = 16


BROKEN = [
    ("SCHED-001", "big-before-small", "fcfs", AdmitsShortestFirst, checks.assert_fcfs_order, ()),
    ("SCHED-002", "long-prompts-arrive-during-decode", "prefill_first", NeverForcesDecodes,
     checks.assert_decode_service, (2,)),
    ("SCHED-006", "aborts", "fcfs", LeaksOnFinish, checks.assert_retire_frees_everything, ()),
    ("SCHED-006", "length-and-eos", "fcfs", ReportsFinishedTwice, checks.assert_retire_frees_everything, ()),
    ("SCHED-005", "long-prompt-chunks", "prefill_first", OverspendsTokens, checks.assert_token_budget, ()),
    ("SCHED-004", "pool-smaller-than-demand", "fcfs", ReservesWholeRequest, checks.assert_kv_budget, ()),
    ("SCHED-009", "longer-than-pool", "fcfs", AcceptsAnything, checks.assert_rejects_impossible, ()),
    ("SCHED-008", "decode-outgrows-pool", "fcfs", PreemptsOldest, checks.assert_preemption, ()),
    ("SCHED-008", "decode-outgrows-pool", "fcfs", RequeuesPreemptedLast, checks.assert_preemption, ()),
    ("SCHED-008", "decode-outgrows-pool", "fcfs", ResumesWithPromptOnly, checks.assert_preemption, ()),
    ("SCHED-010", "chunk-size", "fcfs", IgnoresChunkSize, checks.assert_chunked_prefill_limits, ()),
    ("SCHED-011", "burst", "fcfs", ChunksAnyway, checks.assert_whole_prompts, ()),
]  # fmt: skip


@pytest.mark.parametrize(
    ("clause_id", "case_id", "policy", "broken", "assertion", "extra"),
    BROKEN,
    ids=[f"{row[0]}-{row[3].__name__}" for row in BROKEN],
)
def test_check_fails_a_broken_scheduler_and_passes_the_real_one(
    clause_id, case_id, policy, broken, assertion, extra
):
    case = spec_case(clause_id, case_id)
    assertion(checks.simulate(case, policy), *extra)
    with pytest.raises(AssertionError):
        assertion(checks.simulate(case, policy, scheduler_class=broken), *extra)


def test_bounded_wait_fails_when_the_bound_is_too_tight():
    case = spec_case("SCHED-003", "mixed-sizes")
    sim = checks.simulate(case, "fcfs")
    worst = max(step - sim.arrival(rid).at_step for rid, step in checks.first_admission_steps(sim).items())
    assert worst > 0
    checks.assert_bounded_wait(sim, worst)
    with pytest.raises(AssertionError):
        checks.assert_bounded_wait(sim, worst - 1)
