"""Checks for specs/scheduler: the real Scheduler driven by arrival patterns against a fake runner.

`simulate` runs infer.engine.Scheduler step by step over a real BlockAllocator seen through a
KVCacheManager, with `FakeRunner` in place of the forward: it keeps a row per request it holds
(built from NewRequest, dropped on finished or preempted ids), advances each scheduled row by its
token count, and samples one token for every row whose count reaches its known tokens. The token
sampled at position p is p, so a request recomputed after a preemption samples exactly what it
would have. `scheduler.update` takes the runner's output and ends a request by the engine's token
rules: at max_tokens, or on its EOS token (the one at eos_after); abort_at_step ends one
(`scheduler.abort`).

The check functions judge the recorded decisions against the clause, recomputing what they need
from the decisions themselves (`replay`: tokens computed, known tokens, blocks per request,
admissions, preemptions), not from the scheduler's counters.

`impl` is the scheduler policy, then the variants it runs under: `<policy>[-async][-prefix-cache]`.
`-async` runs as the engine's async scheduling; `-prefix-cache` gives the KVCacheManager a
PrefixTree (owner TREE_OWNER), so requests may be admitted with tokens already computed, share the
tree's blocks read only, and leave their tokens in the tree, which is evicted on demand. Every run
uses the same prompts, drawn from the case's seed (`prompts_of`): they share system prompts and
continue earlier conversations, so that the cache meets misses and hits of every kind.
"""

import functools
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from infer.cache import COPY, OFFLOAD, RESTORE, BlockAllocator, PrefixTree
from infer.cache.prefix_tree import TREE_OWNER
from infer.engine.decision import RunnerOutput, ScheduleDecision
from infer.engine.kv_manager import KVCacheManager
from infer.engine.request import Request, RequestTooLongError
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler

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
    prompt_token_ids: tuple[int, ...]
    eos_after: int | None = None
    abort_at_step: int | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens it generates when it runs to its end."""
        return self.eos_after if self.eos_after is not None else self.max_tokens


class MemoryCall(NamedTuple):
    """One call of the scheduler on its KVCacheManager during schedule()."""

    # "allocated": allocate() gave the blocks; "refused": allocate() answered None; "freed": free()
    # (a preemption); "released": release() (an admission undone, its prefix match given back).
    kind: str
    request_id: str
    # For "refused": the blocks asked for, and what the pool could give at that moment: its free
    # blocks plus those the prefix tree could evict.
    num_blocks: int = 0
    num_obtainable: int = 0


@dataclass
class StepRecord:
    decision: ScheduleDecision
    # Requests aborted at the start of this step (before schedule()).
    aborted: list[str]
    # Requests whose last token this step produced (finish() called after update()).
    finished: list[str]
    waiting_after_schedule: list[str]
    running_after_schedule: list[str]
    # The pool's view once schedule() returned: blocks each owner holds.
    blocks_owned_after_schedule: dict[str, list[int]]
    # Owners of pool blocks once the step is over (after finish()).
    owners_after_step: set[str]
    # The scheduler's calls on its KVCacheManager during schedule(), in order.
    memory_calls: list[MemoryCall] = field(default_factory=list)


@dataclass
class Simulation:
    case: dict
    policy: str
    arrivals: list[Arrival]
    allocator: BlockAllocator
    # The KVCacheManager's prefix tree (a -prefix-cache variant), else None.
    prefix_tree: PrefixTree | None = None
    records: list[StepRecord] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    # Tokens each request got from update(), in order.
    outputs: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    # schedule() once more after the last request left: it reports the last finished ids.
    final_decision: ScheduleDecision | None = None
    # Prefix matches at admission by kind (KVCacheManager.match_counts): empty without the tree.
    match_counts: Counter[str] = field(default_factory=Counter)

    @property
    def decisions(self) -> list[ScheduleDecision]:
        return [record.decision for record in self.records]

    def arrival(self, request_id: str) -> Arrival:
        return next(a for a in self.arrivals if a.request_id == request_id)


class FakeRunner:
    """The runner's side of the contract, without a model: rows built from the decisions alone."""

    def __init__(self):
        # request id -> [known tokens, computed tokens]
        self.rows: dict[str, list[int]] = {}

    def execute(self, decision: ScheduleDecision) -> RunnerOutput:
        for request_id in sorted(decision.finished_request_ids | decision.preempted_request_ids):
            self.rows.pop(request_id, None)
        for new in decision.new_requests:
            self.rows[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        sampled = []
        for request_id, num_tokens in decision.num_scheduled_tokens.items():
            assert request_id in self.rows, (
                f"step {decision.step}: {request_id} is scheduled as a running request but the runner "
                "holds no row for it (it never came as a NewRequest, or was preempted or finished)"
            )
            row = self.rows[request_id]
            row[1] += num_tokens
            if row[1] >= row[0]:
                sampled.append((row[0],))  # the token at position p is p
                row[0] += 1
            else:
                sampled.append(())
        return RunnerOutput(tuple(decision.num_scheduled_tokens), tuple(sampled))


class RecordingKVCacheManager(KVCacheManager):
    """A KVCacheManager that notes the calls the scheduler makes, so that a check can tell which
    requests were scheduled before a preemption within one step, and whether a refusal that led
    to one was real."""

    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_tree: PrefixTree | None = None):
        super().__init__(allocator, block_size, prefix_tree)
        self.calls: list[MemoryCall] = []

    def allocate(self, request, num_new_tokens, num_lookahead_tokens=0):
        # Measured before the call: a refused allocate changes nothing, a granted one evicts.
        num_blocks = KVCacheManager.num_new_blocks(self, request, num_new_tokens, num_lookahead_tokens)
        num_obtainable = self.allocator.num_free + (
            self.prefix_tree.num_evictable_blocks if self.prefix_tree is not None else 0
        )
        new_block_ids = super().allocate(request, num_new_tokens, num_lookahead_tokens)
        if new_block_ids is None:
            self.calls.append(MemoryCall("refused", request.request_id, num_blocks, num_obtainable))
        else:
            self.calls.append(MemoryCall("allocated", request.request_id))
        return new_block_ids

    def free(self, request, *, cache=True):
        self.calls.append(MemoryCall("freed", request.request_id))
        super().free(request, cache=cache)

    def release(self, request):
        num_calls = len(self.calls)
        super().release(request)
        # Its free() undoes an admission that did not happen: no one was preempted.
        del self.calls[num_calls:]
        self.calls.append(MemoryCall("released", request.request_id))


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
    prompts = prompts_of(rows, case["seed"])
    return [
        Arrival(request_id=f"r{i}", index=i, prompt_token_ids=prompt, **row)
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True))
    ]


PROMPT_SHAPES = ("conversation", "system prompt", "system prompt and question", "fresh")
NUM_SYSTEM_PROMPTS = 3
# Token ids of the system prompts and of each request's own text: 1_000_000 * (source + 1) + offset,
# so that no two sources share a token, and none equals a position (what the fake runner samples).
TOKENS_PER_SOURCE = 1_000_000


def prompts_of(rows: list[dict], seed: int) -> list[tuple[int, ...]]:
    """Prompt token ids for the arrival rows, drawn from `seed` (apart from the rows' own draw):
    each prompt is one of four shapes, as a chat service sees them, so that a prefix cache meets
    every kind of match. A conversation goes on from an earlier request's prompt and everything it
    generates (the token at position p is p), then its own text: a prefix hit once that one left.
    The others take a system prompt's first tokens: all of the prompt (a supersequence hit beside a
    longer one), some of it and then their own text (an lcp hit), or none (a miss)."""
    rng = random.Random(f"prompts-{seed}")
    conversations: list[tuple[int, ...]] = []
    prompts = []
    for index, row in enumerate(rows):
        num_tokens = row["prompt_tokens"]
        own = tuple(_source_tokens(NUM_SYSTEM_PROMPTS + index, num_tokens))
        earlier = [c for c in conversations if len(c) <= num_tokens]
        shape = rng.choice(PROMPT_SHAPES)
        if shape == "conversation" and earlier:
            start = rng.choice(earlier)
        else:
            system = _source_tokens(rng.randrange(NUM_SYSTEM_PROMPTS), num_tokens)
            if shape == "system prompt":
                num_shared = num_tokens
            elif shape == "fresh":
                num_shared = 0
            else:  # a question after the system prompt (also a conversation with none to go on from)
                num_shared = rng.randint(1, num_tokens)
            start = tuple(system[:num_shared])
        prompt = start + own[len(start) :]
        num_output_tokens = row["max_tokens"] if row.get("eos_after") is None else row["eos_after"]
        conversations.append(prompt + tuple(range(num_tokens, num_tokens + num_output_tokens)))
        prompts.append(prompt)
    return prompts


def _source_tokens(source: int, num_tokens: int) -> list[int]:
    return [TOKENS_PER_SOURCE * (source + 1) + offset for offset in range(num_tokens)]


ASYNC_SUFFIX = "-async"
PREFIX_CACHE_SUFFIX = "-prefix-cache"


def impl_variants(impl: str) -> tuple[str, bool, bool]:
    """`<policy>[-async][-prefix-cache]` -> (policy, async scheduling, prefix cache)."""
    prefix_caching = impl.endswith(PREFIX_CACHE_SUFFIX)
    impl = impl.removesuffix(PREFIX_CACHE_SUFFIX)
    return impl.removesuffix(ASYNC_SUFFIX), impl.endswith(ASYNC_SUFFIX), prefix_caching


def impl_names(policies) -> list[str]:
    """Every policy under every variant."""
    return [
        policy + async_suffix + cache_suffix
        for policy in policies
        for async_suffix in ("", ASYNC_SUFFIX)
        for cache_suffix in ("", PREFIX_CACHE_SUFFIX)
    ]


def make_scheduler(
    case: dict, policy: str, scheduler_class=Scheduler, *, prefix_caching: bool = False
) -> Scheduler:
    allocator = BlockAllocator(case["kv_blocks"])
    # As the engine builds it (build._build_prefix_tree), with no byte budget: the whole pool.
    prefix_tree = PrefixTree(allocator, case["block_size"]) if prefix_caching else None
    kv_manager = RecordingKVCacheManager(allocator, case["block_size"], prefix_tree)
    return scheduler_class(
        kv_manager=kv_manager,
        max_seq_len=case.get("max_seq_len", case["kv_blocks"] * case["block_size"]),
        max_batch_size=case["max_batch_size"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        policy=policy,
        decode_service_interval=case.get("max_decode_gap", DEFAULT_DECODE_GAP),
        use_chunked_prefill=case["use_chunked_prefill"],
        prefill_chunk_size=case["prefill_chunk_size"],
        max_prefill_chunks_per_step=case.get("max_prefill_chunks_per_step"),
    )


def simulate(case: dict, impl: str, *, scheduler_class=Scheduler) -> Simulation:
    """Runs the case to the end; fails as a livelock if requests remain after max_steps.

    `impl` is `<policy>[-async][-prefix-cache]`. With `-async` it runs as the engine's async
    scheduling does: each step's update() comes after the next step's schedule(), so the scheduler
    plans with the previous step's tokens still pending (and the finishes they cause one step
    late). With `-prefix-cache` the KVCacheManager has a PrefixTree."""
    policy, async_scheduling, prefix_caching = impl_variants(impl)
    scheduler = make_scheduler(case, policy, scheduler_class, prefix_caching=prefix_caching)
    allocator = scheduler.kv_manager.allocator
    arrivals = arrivals_of(case)
    sim = Simulation(case, policy, arrivals, allocator, scheduler.kv_manager.prefix_tree)
    runner = FakeRunner()
    # Decisions run by the fake runner whose outputs update() has not taken yet.
    launched: deque[tuple[ScheduleDecision, RunnerOutput]] = deque()
    by_step: dict[int, list[Arrival]] = defaultdict(list)
    for arrival in sorted(arrivals, key=lambda a: (a.at_step, a.index)):
        by_step[arrival.at_step].append(arrival)
    last_arrival = max(a.at_step for a in arrivals)
    for step in range(case["max_steps"]):
        for arrival in by_step.get(step, []):
            params = SamplingParams(temperature=0.0, max_new_tokens=arrival.max_tokens)
            # The fake runner samples token p at position p: an EOS after eos_after tokens is the
            # token at that position, and Scheduler.update ends the request on it.
            eos = (
                () if arrival.eos_after is None else (len(arrival.prompt_token_ids) + arrival.eos_after - 1,)
            )
            try:
                scheduler.add(
                    Request(
                        arrival.request_id,
                        list(arrival.prompt_token_ids),
                        params,
                        arrival.index,
                        stop_token_ids=frozenset(eos),
                    )
                )
            except RequestTooLongError as error:
                sim.rejected[arrival.request_id] = str(error)
        # As the engine core's abort: those still here get a final output.
        aborting = [a.request_id for a in arrivals if a.abort_at_step == step]
        aborted = [output.request_id for output in scheduler.abort(aborting)]
        memory_calls = getattr(scheduler.kv_manager, "calls", [])
        memory_calls.clear()
        decision = scheduler.schedule()
        record = StepRecord(
            decision=decision,
            aborted=aborted,
            finished=[],
            waiting_after_schedule=[r.request_id for r in scheduler.waiting],
            running_after_schedule=[r.request_id for r in scheduler.running],
            blocks_owned_after_schedule=_blocks_by_owner(allocator),
            owners_after_step=set(),
            memory_calls=list(memory_calls),
        )
        launched.append((decision, runner.execute(decision)))
        while len(launched) > (1 if async_scheduling and not decision.is_empty else 0):
            for output in scheduler.update(*launched.popleft()):
                sim.outputs[output.request_id] += output.new_token_ids
                if output.finished:
                    record.finished.append(output.request_id)
        record.owners_after_step = set(_blocks_by_owner(allocator))
        sim.records.append(record)
        if step >= last_arrival and not scheduler.has_work() and not launched:
            sim.final_decision = scheduler.schedule()
            sim.match_counts = Counter(scheduler.kv_manager.match_counts)
            return sim
    raise AssertionError(
        f"livelock: after max_steps={case['max_steps']} steps {scheduler.num_running} requests still run and "
        f"{scheduler.num_waiting} wait ({[r.request_id for r in scheduler.waiting][:5]}...)"
    )


def _blocks_by_owner(allocator: BlockAllocator) -> dict[str, list[int]]:
    owners: dict[str, list[int]] = defaultdict(list)
    for block in range(allocator.num_blocks):
        for owner in allocator.owners_of(block):
            owners[owner].append(block)
    return dict(owners)


# -- replaying the decisions ----------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One scheduled request in one step, as the decisions alone describe it."""

    request_id: str
    # Tokens computed before this step, and known (prompt + sampled) before this step.
    num_computed: int
    num_known: int
    num_scheduled: int
    # Blocks the request holds once this decision is applied.
    block_ids: tuple[int, ...]
    # Came as a NewRequest: a first admission, or one after a preemption.
    admitted: bool

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.num_known - 1

    @property
    def samples(self) -> bool:
        return self.num_computed + self.num_scheduled == self.num_known


@dataclass
class Replay:
    rows: list[list[Row]]  # per step, in decision order
    # Every admission in order (a request appears again after each preemption).
    admissions: list[tuple[int, str]]
    # Blocks each live request holds after each step's decision.
    live_blocks: list[dict[str, tuple[int, ...]]]


def replay(sim: Simulation) -> Replay:
    """What each decision schedules, tracked from the decisions and the arrivals only."""
    known = {a.request_id: a.prompt_tokens for a in sim.arrivals}
    computed: dict[str, int] = {}
    blocks: dict[str, tuple[int, ...]] = {}
    result = Replay([], [], [])
    for decision in sim.decisions:
        for request_id in decision.finished_request_ids | decision.preempted_request_ids:
            computed.pop(request_id, None)
            blocks.pop(request_id, None)
        for new in decision.new_requests:
            computed[new.request_id] = new.num_computed_tokens
            blocks[new.request_id] = new.block_ids
            result.admissions.append((decision.step, new.request_id))
        for running in decision.running_requests:
            blocks[running.request_id] = blocks.get(running.request_id, ()) + running.new_block_ids
        new_ids = {new.request_id for new in decision.new_requests}
        rows = []
        for request_id, num_tokens in decision.num_scheduled_tokens.items():
            row = Row(
                request_id,
                computed.get(request_id, 0),
                known[request_id],
                num_tokens,
                blocks.get(request_id, ()),
                request_id in new_ids,
            )
            rows.append(row)
            computed[request_id] = row.num_computed + num_tokens
            if row.samples:
                known[request_id] += 1
        result.rows.append(rows)
        result.live_blocks.append(dict(blocks))
    return result


def assert_preempted_wait_first(waiting: list[str], preempted: set[str], order: dict[str, int]) -> None:
    """Preempted requests wait first, in admission order, then those that never ran."""
    kinds = ["preempted" if w in preempted else "never ran" for w in waiting]
    assert kinds == sorted(kinds, key=lambda kind: kind != "preempted"), (
        f"waiting queue {waiting}: preempted requests {sorted(preempted & set(waiting))} must come before "
        "every request that never ran"
    )
    resumed = [w for w in waiting if w in preempted]
    assert resumed == sorted(resumed, key=order.__getitem__), (
        f"preempted requests wait as {resumed}, not in their admission order"
    )


# -- the clauses ----------------------------------------------------------------------------


def fcfs_order(case: dict, impl: str) -> None:
    assert_fcfs_order(simulate(case, impl))


def assert_fcfs_order(sim: Simulation) -> None:
    arrival_key = {a.request_id: (a.at_step, a.index) for a in sim.arrivals}
    admissions_by_step: dict[int, list[str]] = defaultdict(list)
    for step, request_id in replay(sim).admissions:
        admissions_by_step[step].append(request_id)
    ran: set[str] = set()
    first_admissions: list[str] = []
    for record in sim.records:
        step = record.decision.step
        for request_id in admissions_by_step[step]:
            if request_id in ran:
                continue
            # A request that ran and waits again was preempted: it goes before any newcomer.
            ahead = [
                w
                for w in record.waiting_after_schedule
                if w in ran or arrival_key[w] < arrival_key[request_id]
            ]
            assert not ahead, f"step {step}: {request_id} admitted while {ahead}, ahead of it, still wait"
            first_admissions.append(request_id)
        ran |= set(admissions_by_step[step])
    arrival_order = sorted(first_admissions, key=arrival_key.__getitem__)
    assert first_admissions == arrival_order, (
        f"admission order {first_admissions} differs from arrival order {arrival_order}"
    )


def decode_service(case: dict, impl: str) -> None:
    assert_decode_service(simulate(case, impl), case.get("max_decode_gap", DEFAULT_DECODE_GAP))


def assert_decode_service(sim: Simulation, max_gap: int) -> None:
    """Gaps between a request's tokens; a preemption starts a new run of them (it waits again)."""
    served: dict[str, list[int]] = defaultdict(list)
    for decision, rows in zip(sim.decisions, replay(sim).rows, strict=True):
        for request_id in decision.preempted_request_ids:
            _assert_gaps(request_id, served.pop(request_id, []), max_gap)
        for row in rows:
            if row.samples:
                served[row.request_id].append(decision.step)
    for request_id, steps in served.items():
        _assert_gaps(request_id, steps, max_gap)


def _assert_gaps(request_id: str, steps: list[int], max_gap: int) -> None:
    gaps = [later - earlier for earlier, later in zip(steps, steps[1:], strict=False)]
    worst = max(gaps, default=0)
    assert worst <= max_gap, f"{request_id} waited {worst} steps between tokens (bound {max_gap}): {steps}"


def bounded_wait(case: dict, impl: str) -> None:
    assert_bounded_wait(simulate(case, impl), case["max_wait_steps"])


def first_admission_steps(sim: Simulation) -> dict[str, int]:
    admitted_at: dict[str, int] = {}
    for step, request_id in replay(sim).admissions:
        admitted_at.setdefault(request_id, step)
    return admitted_at


def assert_bounded_wait(sim: Simulation, max_wait: int) -> None:
    admitted_at = first_admission_steps(sim)
    for arrival in sim.arrivals:
        assert arrival.request_id in admitted_at, f"{arrival.request_id} was never admitted"
        wait = admitted_at[arrival.request_id] - arrival.at_step
        assert wait <= max_wait, f"{arrival.request_id} waited {wait} steps for admission (bound {max_wait})"


def kv_budget(case: dict, impl: str) -> None:
    assert_kv_budget(simulate(case, impl))


def assert_kv_budget(sim: Simulation) -> None:
    block_size, capacity = sim.case["block_size"], sim.case["kv_blocks"]
    result = replay(sim)
    for record, rows, live in zip(sim.records, result.rows, result.live_blocks, strict=True):
        step = record.decision.step
        held = [block for blocks in live.values() for block in blocks]
        assert len(set(held)) <= capacity, (
            f"step {step}: requests hold {len(set(held))} blocks of a {capacity}-block pool"
        )
        # Two requests hold one block only as a read-only prefix both reuse from the cache.
        cached = set(record.blocks_owned_after_schedule.get(TREE_OWNER, []))
        lent_twice = {block for block, count in Counter(held).items() if count > 1}
        assert lent_twice <= cached, (
            f"step {step}: blocks {sorted(lent_twice - cached)} are lent to two requests"
            + (" and the prefix cache does not hold them" if sim.prefix_tree is not None else "")
        )
        for request_id, blocks in live.items():
            owned = record.blocks_owned_after_schedule.get(request_id, [])
            assert sorted(blocks) == owned, (
                f"step {step}: the decisions give {request_id} blocks {sorted(blocks)}, "
                f"the pool lends it {owned}"
            )
        for row in rows:
            needed = math.ceil((row.num_computed + row.num_scheduled) / block_size)
            assert len(row.block_ids) == needed, (
                f"step {step}: {row.request_id} runs with {row.num_computed + row.num_scheduled} tokens "
                f"({needed} blocks of {block_size}) but holds {len(row.block_ids)} blocks; blocks are taken "
                "as tokens are scheduled, no more, no fewer"
            )
            written = set(row.block_ids[row.num_computed // block_size : needed]) & lent_twice
            assert not written, (
                f"step {step}: {row.request_id} writes tokens {row.num_computed}.."
                f"{row.num_computed + row.num_scheduled - 1} into blocks {sorted(written)}, which another "
                "request also holds; shared blocks are read only"
            )


def token_budget(case: dict, impl: str) -> None:
    assert_token_budget(simulate(case, impl))


def assert_token_budget(sim: Simulation) -> None:
    max_tokens, max_seqs = sim.case["max_num_batched_tokens"], sim.case["max_batch_size"]
    for record, rows in zip(sim.records, replay(sim).rows, strict=True):
        decision = record.decision
        step = decision.step
        prefill_rows = [row for row in rows if row.is_prefill]
        # Chunked prefill off: a prompt no budget holds runs whole in a step with no other prefill.
        whole_long_prompt = (
            not sim.case["use_chunked_prefill"]
            and len(prefill_rows) == 1
            and prefill_rows[0].num_scheduled > max_tokens
        )
        total = decision.total_num_scheduled_tokens
        assert total <= max_tokens or whole_long_prompt, (
            f"step {step}: {total} tokens scheduled, budget {max_tokens}"
        )
        assert len(rows) <= max_seqs, (
            f"step {step}: {len(rows)} requests scheduled, max_batch_size {max_seqs}"
        )
        assert len(record.running_after_schedule) <= max_seqs, (
            f"step {step}: {len(record.running_after_schedule)} requests run, max_batch_size {max_seqs}"
        )
        for row in rows:
            assert 1 <= row.num_scheduled <= row.num_known - row.num_computed, (
                f"step {step}: {row.request_id} is scheduled {row.num_scheduled} tokens with "
                f"{row.num_computed} of {row.num_known} known tokens computed"
            )
    assert_full_token_counts(sim)


def assert_full_token_counts(sim: Simulation) -> None:
    """Every request that was neither rejected nor aborted got all its tokens, no more."""
    for arrival in sim.arrivals:
        if arrival.abort_at_step is None and arrival.request_id not in sim.rejected:
            got = len(sim.outputs.get(arrival.request_id, []))
            assert got == arrival.num_output_tokens, (
                f"{arrival.request_id} finished with {got} tokens, expected {arrival.num_output_tokens}"
            )


def retire_frees_everything(case: dict, impl: str) -> None:
    assert_retire_frees_everything(simulate(case, impl))


def assert_retire_frees_everything(sim: Simulation) -> None:
    gone: set[str] = set()
    held_by_runner: set[str] = set()
    decisions = [*sim.decisions, sim.final_decision]

    def assert_reported_once(request_id: str, index: int) -> None:
        reported = [d.step for d in decisions if request_id in d.finished_request_ids]
        assert reported == [decisions[index].step], (
            f"finished_request_ids named {request_id} in steps {reported}, expected exactly step "
            f"{decisions[index].step} (the first decision after it left)"
        )

    for index, record in enumerate(sim.records):
        decision = record.decision
        step = decision.step
        # Aborts come before this step's schedule(): this decision tells the runner, if it held a row.
        for request_id in record.aborted:
            if request_id in held_by_runner:
                assert_reported_once(request_id, index)
        held_by_runner -= decision.finished_request_ids | decision.preempted_request_ids
        held_by_runner |= {new.request_id for new in decision.new_requests}
        # Finishes come after update(): the next decision tells the runner.
        for request_id in record.finished:
            assert_reported_once(request_id, index + 1)
        retired = set(record.finished) | set(record.aborted)
        leftover = retired & record.owners_after_step
        assert not leftover, f"step {step}: {sorted(leftover)} retired but still hold blocks"
        reappearing = gone & (set(decision.scheduled_request_ids) | set(record.running_after_schedule))
        assert not reappearing, f"step {step}: retired {sorted(reappearing)} scheduled again"
        held_by_runner -= retired
        gone |= retired
    assert_only_the_cache_holds_blocks(sim)


def assert_only_the_cache_holds_blocks(sim: Simulation) -> None:
    """After the last retire no request holds a block: every used block is free, or (with the
    prefix cache) the tree's alone, and no match locks the tree."""
    tree = sim.prefix_tree
    live_owners = [] if tree is None else [TREE_OWNER]
    leaked = sim.allocator.audit(live_owners)
    assert leaked == [], f"blocks still lent after the last retire: {leaked}"
    cached = [] if tree is None else sim.allocator.owned_by(TREE_OWNER)
    assert sim.allocator.num_used == len(cached), (
        f"pool num_used is {sim.allocator.num_used} after the last retire, "
        f"the prefix cache holds {len(cached)} blocks"
    )
    if tree is not None:
        assert sorted(cached) == tree.block_ids(), (
            f"the pool lends the prefix cache blocks {sorted(cached)}, the tree holds {tree.block_ids()}"
        )
        assert tree.num_locked_blocks == 0, (
            f"{tree.num_locked_blocks} blocks of the prefix tree are still locked after the last retire; "
            "a request that leaves unlocks its match"
        )


def deterministic(case: dict, impl: str) -> None:
    digests = {decisions_digest(case, impl) for _ in range(case.get("repeats", 2))}
    # Also in a fresh interpreter with another string-hash seed: set or dict order that depended
    # on hashing would show up there and not within one process.
    digests.add(_digests_in_subprocess(json.dumps(case, sort_keys=True))[impl])
    assert len(digests) == 1, f"the same case gave {len(digests)} different decision sequences"


def decisions_digest(case: dict, impl: str) -> str:
    # Frozensets print in hash order: sorted, so that only a real difference changes the digest.
    decisions = [
        (
            decision.step,
            decision.new_requests,
            decision.running_requests,
            list(decision.num_scheduled_tokens.items()),
            sorted(decision.finished_request_ids),
            sorted(decision.preempted_request_ids),
            decision.block_ops,
        )
        for decision in simulate(case, impl).decisions
    ]
    return hashlib.sha256(repr(decisions).encode()).hexdigest()


@functools.cache
def _digests_in_subprocess(case_json: str) -> dict[str, str]:
    """Every policy's digest under every variant (impl_names), from one interpreter (starting one
    costs seconds: torch's import)."""
    code = (
        "import json, sys; from conformance.scheduler.checks import decisions_digest, impl_names; "
        "from infer.engine.scheduling_policy import POLICIES; case = json.loads(sys.argv[1]); "
        "print(json.dumps({impl: decisions_digest(case, impl) for impl in impl_names(POLICIES)}))"
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


def preemption(case: dict, impl: str) -> None:
    assert_preemption(simulate(case, impl))


def assert_preemption(sim: Simulation) -> None:
    result = replay(sim)
    num_preemptions = sum(len(decision.preempted_request_ids) for decision in sim.decisions)
    if sim.case.get("expect_preemption"):
        assert num_preemptions > 0, "the pool ran out during decode but no request was preempted"
    admissions_by_step: dict[int, list[str]] = defaultdict(list)
    for step, request_id in result.admissions:
        admissions_by_step[step].append(request_id)
    # Each running or preempted request's latest admission, numbered in order.
    admission_order: dict[str, int] = {}
    num_admissions = 0
    waiting_preempted: set[str] = set()
    live: set[str] = set()
    for record, rows in zip(sim.records, result.rows, strict=True):
        decision = record.decision
        step = decision.step
        scheduled = set(decision.num_scheduled_tokens)
        preempted = set(decision.preempted_request_ids)
        live -= decision.finished_request_ids
        freed = [call.request_id for call in record.memory_calls if call.kind == "freed"]
        assert sorted(freed) == sorted(preempted), (
            f"step {step}: schedule() freed the blocks of {freed}, the decision preempts {sorted(preempted)}"
        )
        served_so_far: set[str] = set()
        for call in record.memory_calls:
            request_id = call.request_id
            if call.kind == "allocated":
                served_so_far.add(request_id)
            if call.kind != "freed":
                continue
            assert request_id in live and request_id not in scheduled, (
                f"step {step}: {request_id} is preempted but was not running, "
                "or is scheduled in the same step"
            )
            spared = [
                other
                for other in live - served_so_far
                if admission_order[other] > admission_order[request_id]
            ]
            assert not spared, (
                f"step {step}: {request_id} was preempted while {sorted(spared)}, admitted after it and not "
                "yet scheduled in this step, kept running; the most recently admitted goes first"
            )
            live.discard(request_id)
        for request_id in sorted(preempted):
            still_owned = record.blocks_owned_after_schedule.get(request_id, [])
            assert not still_owned, f"step {step}: preempted {request_id} still holds blocks {still_owned}"
        live -= preempted
        waiting_preempted |= preempted
        for request_id in admissions_by_step[step]:
            admission_order[request_id] = num_admissions
            num_admissions += 1
        live |= set(admissions_by_step[step])
        waiting_preempted -= set(admissions_by_step[step])
        live -= set(record.finished) | set(record.aborted)
        assert_preempted_wait_first(record.waiting_after_schedule, waiting_preempted, admission_order)
        for row in rows:
            if row.admitted and row.num_known > sim.arrival(row.request_id).prompt_tokens:
                new = next(n for n in decision.new_requests if n.request_id == row.request_id)
                prompt = sim.arrival(row.request_id).prompt_tokens
                expected = sim.arrival(row.request_id).prompt_token_ids + tuple(range(prompt, row.num_known))
                assert new.token_ids == expected, (
                    f"step {step}: resumed {row.request_id} came back with token_ids "
                    f"{new.token_ids[prompt:]} after its prompt, expected {expected[prompt:]} "
                    "(everything it had generated)"
                )
    assert_full_token_counts(sim)


def chunked_prefill_limits(case: dict, impl: str) -> None:
    assert_chunked_prefill_limits(simulate(case, impl))


def assert_chunked_prefill_limits(sim: Simulation) -> None:
    assert sim.case["use_chunked_prefill"], "this clause's cases must set use_chunked_prefill: true"
    chunk_size = sim.case["prefill_chunk_size"]
    max_rows = sim.case.get("max_prefill_chunks_per_step")
    num_chunked = 0
    for record, rows in zip(sim.records, replay(sim).rows, strict=True):
        prefill_rows = [row for row in rows if row.is_prefill]
        for row in prefill_rows:
            assert row.num_scheduled <= chunk_size, (
                f"step {record.decision.step}: {row.request_id} prefills {row.num_scheduled} tokens, "
                f"prefill_chunk_size is {chunk_size}"
            )
            num_chunked += row.num_scheduled < row.num_known - row.num_computed
        assert max_rows is None or len(prefill_rows) <= max_rows, (
            f"step {record.decision.step}: {len(prefill_rows)} prefill rows, "
            f"max_prefill_chunks_per_step is {max_rows}"
        )
    assert num_chunked > 0, "no prompt was split: the case does not exercise chunking"
    assert_full_token_counts(sim)


def whole_prompts(case: dict, impl: str) -> None:
    assert_whole_prompts(simulate(case, impl))


def assert_whole_prompts(sim: Simulation) -> None:
    assert not sim.case["use_chunked_prefill"], "this clause's cases must set use_chunked_prefill: false"
    for record, rows in zip(sim.records, replay(sim).rows, strict=True):
        for row in rows:
            if row.is_prefill:
                assert row.admitted and row.num_scheduled == row.num_known - row.num_computed, (
                    f"step {record.decision.step}: {row.request_id} runs {row.num_scheduled} of its "
                    f"{row.num_known - row.num_computed} uncomputed tokens; without chunked prefill a prompt "
                    "(or a recompute) runs whole in the step that admits it"
                )
    assert_full_token_counts(sim)


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


def evicts_before_preempting(case: dict, impl: str) -> None:
    assert_evicts_before_preempting(simulate(case, impl))


def assert_evicts_before_preempting(sim: Simulation) -> None:
    """Every preemption follows the refusal that caused it, and every refusal was real: the free
    blocks and those the prefix tree could evict together fell short of the blocks asked for."""
    for record in sim.records:
        step = record.decision.step
        previous = None
        for call in record.memory_calls:
            if call.kind == "refused":
                assert call.num_blocks > call.num_obtainable, (
                    f"step {step}: allocate refused {call.request_id} {call.num_blocks} blocks while "
                    f"{call.num_obtainable} were free or held only by the prefix cache (evictable); "
                    "evict the cache's blocks before refusing"
                )
            if call.kind == "freed":
                assert previous is not None and previous.kind == "refused", (
                    f"step {step}: {call.request_id} was preempted without a refused allocate before it "
                    f"(calls this step: {[(c.kind, c.request_id) for c in record.memory_calls]}); preempt "
                    "only when the pool, its evictable cached blocks included, cannot serve a request"
                )
            previous = call
    if sim.prefix_tree is not None and sim.case.get("expect_eviction"):
        assert sim.prefix_tree.num_evicted_blocks > 0, (
            "the prefix cache never had to give blocks back: the case does not exercise eviction"
        )
    assert_full_token_counts(sim)


def reads_own_tokens(case: dict, impl: str) -> None:
    assert_reads_own_tokens(simulate(case, impl))


def assert_reads_own_tokens(sim: Simulation) -> None:
    """Replays the decisions on a model of the pool's KV: `kv[block][offset]` is the token whose K/V
    that place of the block holds. Each step runs the decision's block_ops in order (before the
    forward), writes every scheduled token into its block (the forward writes all its K/V before
    attention reads), then checks that every scheduled request finds its own tokens at every
    position it attends to."""
    block_size = sim.case["block_size"]
    kv: dict[int, list[int | None]] = defaultdict(lambda: [None] * block_size)
    stored: dict[int, list[int | None]] = defaultdict(lambda: [None] * block_size)  # by slot
    token_ids: dict[str, list[int]] = {}
    for decision, rows in zip(sim.decisions, replay(sim).rows, strict=True):
        step = decision.step
        for new in decision.new_requests:
            token_ids[new.request_id] = list(new.token_ids)
        for kind, source, target in decision.block_ops:
            if kind == COPY:
                kv[target] = list(kv[source])
            elif kind == OFFLOAD:
                stored[target] = list(kv[source])
            elif kind == RESTORE:
                kv[target] = list(stored[source])
            else:
                raise AssertionError(f"step {step}: unknown block operation {kind!r} ({source} -> {target})")
        for row in rows:
            end = row.num_computed + row.num_scheduled
            assert len(row.block_ids) * block_size >= end, (
                f"step {step}: {row.request_id} runs up to position {end - 1} with blocks {row.block_ids}"
            )
            tokens = token_ids[row.request_id]
            for position in range(row.num_computed, end):
                kv[row.block_ids[position // block_size]][position % block_size] = tokens[position]
        for row in rows:
            tokens = token_ids[row.request_id]
            end = row.num_computed + row.num_scheduled
            for index in range(math.ceil(end / block_size)):
                first, last = index * block_size, min(end, (index + 1) * block_size)
                block = row.block_ids[index]
                held = kv[block][: last - first]
                assert held == tokens[first:last], (
                    f"step {step}: {row.request_id} attends to positions {first}..{last - 1} in block "
                    f"{block}, which holds the K/V of tokens {held}, not its own {tokens[first:last]} "
                    f"({row.num_computed} tokens computed before this step, admitted in it: {row.admitted})"
                )
            if row.samples:
                tokens.append(len(tokens))  # the fake runner samples token p at position p
