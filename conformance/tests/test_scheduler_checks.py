"""The scheduler checks catch real bugs: each broken scheduler below fails its own clause's check
on that clause's own case from specs/scheduler, where the real Scheduler passes."""

import pytest
import yaml

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from infer.engine.scheduler import Scheduler

checks = load_checks_module(CHECKS_DIR, "scheduler")
SPEC = yaml.safe_load((CHECKS_DIR.parent / "specs" / "scheduler" / "scheduling.yaml").read_text())


def spec_case(clause_id: str, case_id: str) -> dict:
    clause = next(c for c in SPEC["clauses"] if c["id"] == clause_id)
    return {**SPEC["defaults"], **next(c for c in clause["cases"] if c["id"] == case_id)}


class AdmitsShortestFirst(Scheduler):
    """Lets a small request overtake a large one that waits for KV room."""

    def _admit(self, step, admitted, serve, budget_left):
        self._waiting = type(self._waiting)(sorted(self._waiting, key=lambda r: r.max_total_tokens))
        super()._admit(step, admitted, serve, budget_left)


class NeverForcesDecodes(Scheduler):
    def _due_decoders(self, step):
        return []


class LeaksOnRemove(Scheduler):
    def remove(self, request_id):
        request = self._requests.pop(request_id, None)
        if request is not None:
            (self._waiting if request in self._waiting else self._running).remove(request)
            request.kv_blocks = []  # forgets to free them in the pool
        return request


class OverspendsTokens(Scheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.max_num_batched_tokens += 8


class ReservesOneBlock(Scheduler):
    def blocks_needed(self, num_tokens):
        return 1


class AcceptsAnything(Scheduler):
    def check_fits(self, num_prompt_tokens, max_new_tokens):
        pass


BROKEN = [
    ("SCHED-001", "big-before-small", "fcfs", AdmitsShortestFirst, checks.assert_fcfs_order, ()),
    ("SCHED-002", "long-prompts-arrive-during-decode", "prefill_first", NeverForcesDecodes,
     checks.assert_decode_service, (2,)),
    ("SCHED-006", "aborts", "fcfs", LeaksOnRemove, checks.assert_retire_frees_everything, ()),
    ("SCHED-005", "long-prompt-chunks", "prefill_first", OverspendsTokens, checks.assert_token_budget, ()),
    ("SCHED-004", "pool-smaller-than-demand", "fcfs", ReservesOneBlock, checks.assert_kv_budget, ()),
    ("SCHED-009", "longer-than-pool", "fcfs", AcceptsAnything, checks.assert_rejects_impossible, ()),
]  # fmt: skip


@pytest.mark.parametrize(
    ("clause_id", "case_id", "policy", "broken", "assertion", "extra"), BROKEN, ids=[row[0] for row in BROKEN]
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
    worst = max(step - sim.arrival(rid).at_step for rid, step in sim.admitted_step().items())
    assert worst > 0
    checks.assert_bounded_wait(sim, worst)
    with pytest.raises(AssertionError):
        checks.assert_bounded_wait(sim, worst - 1)
