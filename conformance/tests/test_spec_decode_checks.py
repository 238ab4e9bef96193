"""The spec_decode checks catch real bugs: each broken scheduler below fails its clause's check on
a case from specs/spec_decode, where the real Scheduler passes."""

import dataclasses

import pytest
import yaml

from conformance.plugin import CHECKS_DIR
from conformance.spec import load_checks_module
from infer.engine.scheduler import Scheduler

checks = load_checks_module(CHECKS_DIR, "spec_decode")
SPEC = yaml.safe_load((CHECKS_DIR.parent / "specs" / "spec_decode" / "spec_decode.yaml").read_text())


def spec_case(clause_id: str, case_id: str) -> dict:
    clause = next(c for c in SPEC["clauses"] if c["id"] == clause_id)
    return {**SPEC["defaults"], **next(c for c in clause["cases"] if c["id"] == case_id)}


class DraftsPastTheBudget(Scheduler):
    """Drafts as if the step's token budget had no end."""

    def _drafts(self, request, plan):
        budget, plan.budget = plan.budget, 1_000_000
        try:
            return super()._drafts(request, plan)
        finally:
            plan.budget = budget


class DraftsPastMaxTokens(Scheduler):
    """Drafts as if max_new_tokens were 100 more."""

    def _drafts(self, request, plan):
        params = request.params
        request.params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens + 100)
        try:
            return super()._drafts(request, plan)
        finally:
            request.params = params


class SpeculatesAtAnyBatchSize(Scheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.disable_speculation_above = None


class RollsBackOneTokenTooMany(Scheduler):
    """Recomputes one accepted token after every verdict: greedy tokens stay right (a token's
    K/V computed twice is the same), the bookkeeping does not."""

    def update(self, decision, runner_output):
        outputs = super().update(decision, runner_output)
        for request_id in decision.spec_token_ids:
            request = self.get(request_id)
            if request is not None and request.num_computed_tokens:
                request.num_computed_tokens -= 1
        return outputs


class DropsRolledBackBlocks(Scheduler):
    """After a verdict, forgets the blocks past a request's computed tokens without freeing them."""

    def update(self, decision, runner_output):
        outputs = super().update(decision, runner_output)
        for request_id in decision.spec_token_ids:
            request = self.get(request_id)
            if request is not None:
                blocks = self.kv_manager._blocks.get(request_id, [])
                del blocks[-(-request.num_computed_tokens // self.kv_manager.block_size) :]
        return outputs


BROKEN_SCHEDULING = [
    ("tight-budget", DraftsPastTheBudget),
    ("max-tokens-cut-drafts", DraftsPastMaxTokens),
    ("batch-size-back-off", SpeculatesAtAnyBatchSize),
    ("tight-budget", RollsBackOneTokenTooMany),
]


@pytest.mark.parametrize(
    ("case_id", "broken"), BROKEN_SCHEDULING, ids=[b.__name__ for _, b in BROKEN_SCHEDULING]
)
def test_draft_budget_fails_a_broken_scheduler_and_passes_the_real_one(case_id, broken):
    case = spec_case("SPEC-004", case_id)
    checks.assert_draft_budget(checks.simulate_drafts(case))
    with pytest.raises(AssertionError):
        checks.assert_draft_budget(checks.simulate_drafts(case, broken))


@pytest.mark.parametrize(
    "broken", [RollsBackOneTokenTooMany, DropsRolledBackBlocks], ids=lambda b: b.__name__
)
def test_no_kv_leak_fails_a_broken_scheduler(broken):
    # The real scheduler passes this case in the SPEC-003 suite itself.
    run = checks.run_engine(spec_case("SPEC-003", "llama-tiny-paged"), broken)
    with pytest.raises(AssertionError):
        checks.assert_no_kv_leak(run)
