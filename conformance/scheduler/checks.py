"""Checks for specs/scheduler: the real Scheduler driven by arrival patterns against a fake model.

`simulate` runs infer.engine.Scheduler step by step over a real SlotAllocator (one id = one KV
block) with a fake model in place of the forward: every prefill chunk that ends a prompt and
every decode yields one token, and a request finishes at max_tokens (or eos_after). The check
functions then judge the recorded ScheduleDecisions against the clause, recomputing what they
need from the decisions themselves (chunk sums, tokens in cache, wait times) rather than from
the scheduler's own counters. `impl` is the scheduler policy.
"""

import functools
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from infer.cache import SlotAllocator
from infer.engine.request import Request, RequestTooLongError
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import ScheduleDecision, Scheduler

REPO_ROOT = Path(__file__).resolve().parents[2]
# The engine's default fairness bound, used when a case does not set max_decode_gap.
DEFAULT_DECODE_GAP = 4


@dataclass(frozen=True)
class Arrival:
    request_id: str
    index: int
    at_step: int
    prompt_tokens: int
    max_tokens: int
    eos_after: int | None = None
    abort_at_step: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.eos_after if self.eos_after is not None else self.max_tokens


@dataclass
class StepRecord:
    decision: ScheduleDecision
    # Requests aborted at the start of this step (before schedule()).
    aborted: list[str]
    # Requests whose last token this step produced (retired by update() in this step).
    finished: list[str]
    waiting_after_schedule: list[str]
    running_after_schedule: list[str]
    # Blocks each running request holds while the step runs.
    blocks_held: dict[str, int]
    # Owners of pool blocks once the step is over (after retire).
    owners_after_step: set[str]


@dataclass
class Simulation:
    case: dict
    policy: str
    arrivals: list[Arrival]
    records: list[StepRecord] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    pool: SlotAllocator | None = None

    @property
    def decisions(self) -> list[ScheduleDecision]:
        return [record.decision for record in self.records]

    def admitted_step(self) -> dict[str, int]:
        return {rid: r.decision.step for r in self.records for rid in r.decision.admitted}

    def arrival(self, request_id: str) -> Arrival:
        return next(a for a in self.arrivals if a.request_id == request_id)


def arrivals_of(case: dict) -> list[Arrival]:
    """The case's arrival pattern as a list (ids r0, r1, ... in list or generation order)."""
    spec = case["arrivals"]
    if isinstance(spec, list):
        rows = spec
    elif spec.get("random"):
        rng = random.Random(case["seed"])
        rows = [
            {
                "at_step": rng.randint(0, spec["max_arrival_step"]),
                "prompt_tokens": rng.randint(*spec["prompt_tokens"]),
                "max_tokens": rng.randint(*spec["max_tokens"]),
            }
            for _ in range(spec["count"])
        ]
    else:
        rows = [
            {
                "at_step": i * spec["every_n_steps"],
                "prompt_tokens": spec["prompt_tokens"],
                "max_tokens": spec["max_tokens"],
            }
            for i in range(spec["count"])
        ]
    return [Arrival(request_id=f"r{i}", index=i, **row) for i, row in enumerate(rows)]


def make_scheduler(case: dict, policy: str, scheduler_class=Scheduler) -> Scheduler:
    pool = SlotAllocator(case["kv_blocks"])
    return scheduler_class(
        kv_pool=pool,
        kv_block_size=case["block_size"],
        max_seq_len=case.get("max_seq_len", case["kv_blocks"] * case["block_size"]),
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        policy=policy,
        decode_service_interval=case.get("max_decode_gap", DEFAULT_DECODE_GAP),
    )


def simulate(case: dict, policy: str, *, scheduler_class=Scheduler) -> Simulation:
    """Runs the case to the end; fails as a livelock if requests remain after max_steps."""
    scheduler = make_scheduler(case, policy, scheduler_class)
    arrivals = arrivals_of(case)
    sim = Simulation(case, policy, arrivals, pool=scheduler.kv_pool)
    by_step: dict[int, list[Arrival]] = defaultdict(list)
    for arrival in sorted(arrivals, key=lambda a: (a.at_step, a.index)):
        by_step[arrival.at_step].append(arrival)
    last_arrival = max(a.at_step for a in arrivals)
    generated: dict[str, int] = defaultdict(int)
    for step in range(case["max_steps"]):
        for arrival in by_step.get(step, []):
            params = SamplingParams(temperature=0.0, max_new_tokens=arrival.max_tokens)
            try:
                scheduler.add(Request(arrival.request_id, [0] * arrival.prompt_tokens, params, arrival.index))
            except RequestTooLongError as error:
                sim.rejected[arrival.request_id] = str(error)
        aborted = [
            a.request_id
            for a in arrivals
            if a.abort_at_step == step and scheduler.remove(a.request_id) is not None
        ]
        decision = scheduler.schedule()
        producing = [c.request_id for c in decision.prefills if c.completes_prompt] + list(decision.decodes)
        finished = []
        for request_id in producing:
            generated[request_id] += 1
            if generated[request_id] == sim.arrival(request_id).num_tokens:
                finished.append(request_id)
        blocks_held = {r.request_id: len(r.kv_blocks) for r in scheduler.running}
        record = StepRecord(
            decision=decision,
            aborted=aborted,
            finished=finished,
            waiting_after_schedule=[r.request_id for r in scheduler.waiting],
            running_after_schedule=[r.request_id for r in scheduler.running],
            blocks_held=blocks_held,
            owners_after_step=set(),
        )
        scheduler.update(decision, finished=finished)
        record.owners_after_step = _owners(scheduler.kv_pool)
        sim.records.append(record)
        if step >= last_arrival and not scheduler.has_work():
            return sim
    raise AssertionError(
        f"livelock: after max_steps={case['max_steps']} steps {scheduler.num_running} requests still run and "
        f"{scheduler.num_waiting} wait ({[r.request_id for r in scheduler.waiting][:5]}...)"
    )


def _owners(pool: SlotAllocator) -> set[str]:
    return {owner for block in range(pool.capacity) if (owner := pool.owner_of(block)) is not None}


# -- the clauses ----------------------------------------------------------------------------


def fcfs_order(case: dict, impl: str) -> None:
    assert_fcfs_order(simulate(case, impl))


def assert_fcfs_order(sim: Simulation) -> None:
    admitted = [rid for decision in sim.decisions for rid in decision.admitted]
    arrival_order = [
        a.request_id
        for a in sorted(sim.arrivals, key=lambda a: (a.at_step, a.index))
        if a.request_id not in sim.rejected and a.request_id in admitted
    ]
    assert admitted == arrival_order, f"admission order {admitted} differs from arrival order {arrival_order}"
    for record in sim.records:
        step = record.decision.step
        for rid in record.decision.admitted:
            earlier_waiting = [
                w
                for w in record.waiting_after_schedule
                if (sim.arrival(w).at_step, sim.arrival(w).index)
                < (sim.arrival(rid).at_step, sim.arrival(rid).index)
            ]
            assert not earlier_waiting, (
                f"step {step}: {rid} admitted while earlier {earlier_waiting} still wait"
            )


def decode_service(case: dict, impl: str) -> None:
    assert_decode_service(simulate(case, impl), case.get("max_decode_gap", DEFAULT_DECODE_GAP))


def assert_decode_service(sim: Simulation, max_gap: int) -> None:
    served: dict[str, list[int]] = defaultdict(list)
    for record in sim.records:
        step = record.decision.step
        for chunk in record.decision.prefills:
            if chunk.completes_prompt:
                served[chunk.request_id].append(step)
        for rid in record.decision.decodes:
            served[rid].append(step)
    for rid, steps in served.items():
        gaps = [later - earlier for earlier, later in zip(steps, steps[1:], strict=False)]
        worst = max(gaps, default=0)
        assert worst <= max_gap, (
            f"{rid} waited {worst} steps between decode tokens (bound {max_gap}): {steps}"
        )


def bounded_wait(case: dict, impl: str) -> None:
    assert_bounded_wait(simulate(case, impl), case["max_wait_steps"])


def assert_bounded_wait(sim: Simulation, max_wait: int) -> None:
    admitted_at = sim.admitted_step()
    for arrival in sim.arrivals:
        assert arrival.request_id in admitted_at, f"{arrival.request_id} was never admitted"
        wait = admitted_at[arrival.request_id] - arrival.at_step
        assert wait <= max_wait, f"{arrival.request_id} waited {wait} steps for admission (bound {max_wait})"


def kv_budget(case: dict, impl: str) -> None:
    assert_kv_budget(simulate(case, impl))


def assert_kv_budget(sim: Simulation) -> None:
    block_size, capacity = sim.case["block_size"], sim.case["kv_blocks"]
    in_cache: dict[str, int] = defaultdict(int)
    for record in sim.records:
        step = record.decision.step
        total = sum(record.blocks_held.values())
        assert total <= capacity, (
            f"step {step}: running requests hold {total} blocks of a {capacity}-block pool"
        )
        scheduled = [(c.request_id, c.num_tokens) for c in record.decision.prefills]
        scheduled += [(rid, 1) for rid in record.decision.decodes]
        for rid, num_tokens in scheduled:
            in_cache[rid] += num_tokens
            held = record.blocks_held.get(rid, 0)
            needed = math.ceil(in_cache[rid] / block_size)
            assert needed <= held, (
                f"step {step}: {rid} runs with {in_cache[rid]} tokens in cache ({needed} blocks) "
                f"but holds {held}"
            )


def token_budget(case: dict, impl: str) -> None:
    assert_token_budget(simulate(case, impl))


def assert_token_budget(sim: Simulation) -> None:
    max_tokens, max_seqs = sim.case["max_num_batched_tokens"], sim.case["max_num_seqs"]
    prefilled: dict[str, int] = defaultdict(int)
    for record in sim.records:
        decision = record.decision
        step = decision.step
        assert decision.num_scheduled_tokens <= max_tokens, (
            f"step {step}: {decision.num_scheduled_tokens} tokens scheduled, budget {max_tokens}"
        )
        ids = decision.scheduled_request_ids
        assert len(ids) == len(set(ids)), f"step {step}: a request is scheduled twice: {ids}"
        assert len(record.running_after_schedule) <= max_seqs, (
            f"step {step}: {len(record.running_after_schedule)} requests run, max_num_seqs {max_seqs}"
        )
        for chunk in decision.prefills:
            assert chunk.num_tokens >= 1, f"step {step}: empty prefill chunk {chunk}"
            assert chunk.start == prefilled[chunk.request_id], (
                f"step {step}: {chunk.request_id}'s chunk starts at {chunk.start}, "
                f"but {prefilled[chunk.request_id]} prompt tokens were prefilled before"
            )
            prefilled[chunk.request_id] += chunk.num_tokens
            prompt = sim.arrival(chunk.request_id).prompt_tokens
            assert chunk.completes_prompt == (prefilled[chunk.request_id] == prompt), (
                f"step {step}: {chunk} says completes_prompt={chunk.completes_prompt} "
                f"at {prefilled[chunk.request_id]} of {prompt} prompt tokens"
            )
        for rid in decision.decodes:
            assert prefilled[rid] == sim.arrival(rid).prompt_tokens, (
                f"step {step}: {rid} decodes before its prompt is in"
            )
    for arrival in sim.arrivals:
        if arrival.abort_at_step is None and arrival.request_id not in sim.rejected:
            assert prefilled[arrival.request_id] == arrival.prompt_tokens, (
                f"{arrival.request_id}'s chunks sum to {prefilled[arrival.request_id]}, its prompt has "
                f"{arrival.prompt_tokens} tokens"
            )


def retire_frees_everything(case: dict, impl: str) -> None:
    assert_retire_frees_everything(simulate(case, impl))


def assert_retire_frees_everything(sim: Simulation) -> None:
    gone: set[str] = set()
    for record in sim.records:
        step = record.decision.step
        leftover = (set(record.finished) | set(record.aborted)) & record.owners_after_step
        assert not leftover, f"step {step}: {sorted(leftover)} retired but still hold blocks"
        reappearing = gone & (set(record.decision.scheduled_request_ids) | set(record.running_after_schedule))
        assert not reappearing, f"step {step}: retired {sorted(reappearing)} scheduled again"
        gone |= set(record.finished) | set(record.aborted)
    assert sim.pool.audit([]) == [], f"blocks still lent after the last retire: {sim.pool.audit([])}"
    assert sim.pool.num_used == 0, f"pool num_used is {sim.pool.num_used} after the last retire"


def deterministic(case: dict, impl: str) -> None:
    digests = {decisions_digest(case, impl) for _ in range(case.get("repeats", 2))}
    # Also in a fresh interpreter with another string-hash seed: set or dict order that depended
    # on hashing would show up there and not within one process.
    digests.add(_digests_in_subprocess(json.dumps(case, sort_keys=True))[impl])
    assert len(digests) == 1, f"the same case gave {len(digests)} different decision sequences"


def decisions_digest(case: dict, policy: str) -> str:
    decisions = simulate(case, policy).decisions
    return hashlib.sha256(repr(decisions).encode()).hexdigest()


@functools.cache
def _digests_in_subprocess(case_json: str) -> dict[str, str]:
    """Every policy's digest from one interpreter (starting one costs seconds: torch's import)."""
    code = (
        "import json, sys; from conformance.scheduler.checks import decisions_digest; "
        "from infer.engine.scheduling_policy import POLICIES; case = json.loads(sys.argv[1]); "
        "print(json.dumps({policy: decisions_digest(case, policy) for policy in POLICIES}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, case_json],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def rejects_impossible(case: dict, impl: str) -> None:
    assert_rejects_impossible(simulate(case, impl))


def assert_rejects_impossible(sim: Simulation) -> None:
    max_seq_len = sim.case.get("max_seq_len", sim.case["kv_blocks"] * sim.case["block_size"])
    pool_tokens = sim.case["kv_blocks"] * sim.case["block_size"]
    expected = {
        a.request_id for a in sim.arrivals if a.prompt_tokens + a.max_tokens > min(max_seq_len, pool_tokens)
    }
    assert set(sim.rejected) == expected, (
        f"rejected {sorted(sim.rejected)}, expected exactly {sorted(expected)}"
    )
    for request_id, message in sim.rejected.items():
        arrival = sim.arrival(request_id)
        limit = "max_seq_len" if arrival.prompt_tokens + arrival.max_tokens > max_seq_len else "pool"
        assert limit in message, f"{request_id} rejected with {message!r}, which does not name the {limit}"
    scheduled = {rid for decision in sim.decisions for rid in decision.scheduled_request_ids}
    assert not scheduled & expected, f"rejected requests were scheduled: {sorted(scheduled & expected)}"
    assert scheduled == {a.request_id for a in sim.arrivals} - expected, "an admissible request never ran"
