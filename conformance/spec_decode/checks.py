"""Checks for specs/spec_decode: speculative decoding changes nothing but speed.

Engine clauses (SPEC-001, SPEC-003) run a real Engine on a tiny random checkpoint, once per case
(`engine_run`, cached: both clauses judge the same run) with a spy on its scheduler's schedule()
and update() that records each decision, each verdict, and which blocks the pool lends to whom
after each. The oracles are the same engine's tokens without speculation and the recompute oracle
(conformance/oracles.py: no cache, no batching, no scheduler).

SPEC-002 runs infer.engine.spec_decode.rejection_sample on synthetic distributions and judges it
with conformance/lossless.py's statistical tests.

SPEC-004 drives infer.engine.Scheduler with a real NgramProposer over a real BlockAllocator and
`SpeculatingRunner` in place of the forward: the token at position p is a fixed function of p
that cycles (so n-gram lookups find drafts, and they are right), and for a row with K drafts the
runner accepts a seeded-random number of them (0..K, no more than are right) and emits those and
the token after them, as a verifying target would.
"""

import atexit
import functools
import json
import math
import random
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from conformance.engine_runs import run_to_completion, token_ids
from conformance.lossless import lossless_failures, make_case, run_sampler
from conformance.oracles import RecomputeOracle
from conformance.scheduler.checks import arrivals_of
from infer.cache import BlockAllocator, PrefixTree
from infer.cache.prefix_tree import TREE_OWNER
from infer.engine.config import EngineConfig
from infer.engine.decision import RunnerOutput, ScheduleDecision
from infer.engine.engine import Engine
from infer.engine.kv_manager import KVCacheManager
from infer.engine.request import Request
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.spec_decode import NgramProposer, SpeculativeConfig
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

# EngineConfig fields of every engine case, under the case's own `engine` fields.
ENGINE_BASE = dict(max_batch_size=3, max_num_batched_tokens=32, max_seq_len=160)

# -- engine runs (SPEC-001, SPEC-003) -------------------------------------------------------


@dataclass
class StepLog:
    """One engine step as the spy saw it."""

    decision: ScheduleDecision
    # Running requests once schedule() returned.
    running_after: list[str]
    # Blocks each owner holds once schedule() returned, and once update() returned.
    owned_after_schedule: dict[str, list[int]]
    owned_after_update: dict[str, list[int]] = field(default_factory=dict)
    # Per request: the tokens the runner sampled (accepted drafts, then the target's token).
    sampled: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Requests that finished in this step's update().
    finished: list[str] = field(default_factory=list)


@dataclass
class EngineRun:
    case: dict
    block_size: int
    num_speculative_tokens: int
    prompts: list[list[int]]
    tokens: list[list[int]]  # per prompt, with speculation
    plain_tokens: list[list[int]]  # per prompt, the same engine without speculation
    oracle_tokens: list[list[int]]
    steps: list[StepLog]
    num_accepted: int
    num_drafted: int
    num_preempted: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache, over every request
    leaked: list[int]  # allocator.audit([TREE_OWNER]) once every request finished
    num_used: int
    tree_blocks: int | None  # blocks the prefix tree holds at the end (None: no tree)
    tree_locked: int


def greedy_identity(case: dict, impl: str | None) -> None:
    assert_greedy_identity(engine_run(case))


def assert_greedy_identity(run: EngineRun) -> None:
    case = run.case
    for index, (got, plain, oracle) in enumerate(
        zip(run.tokens, run.plain_tokens, run.oracle_tokens, strict=True)
    ):
        first = _first_difference(got, oracle)
        assert got == oracle, (
            f"request {index}: with speculation {len(got)} tokens, the recompute oracle's {len(oracle)}; "
            f"first difference at output {first}: {got[first : first + 5]} vs {oracle[first : first + 5]}"
        )
        assert plain == oracle, f"request {index}: without speculation the engine differs from the oracle"
    assert 0 < run.num_accepted < run.num_drafted, (
        f"{run.num_accepted} of {run.num_drafted} drafts accepted: the case must accept some and reject some"
    )
    assert any(len(set(_accepted_per_row(step).values())) > 1 for step in run.steps), (
        "no step verified rows that accepted different numbers of drafts"
    )
    if case.get("expect_preemption"):
        assert run.num_preempted > 0, "the case is meant to preempt, and nothing was preempted"
    if case.get("follow_up"):
        assert run.num_cached_tokens > 0, "the second wave reused nothing from the prefix cache"


def greedy_identity_draft_model(case: dict, impl: str | None) -> None:
    """SPEC-001's case with a draft model: a copy of the case's checkpoint whose weights carry
    noise (its drafts are right where the target's choice is clear, wrong elsewhere)."""
    model, _ = _tiny_model(case["preset"])
    speculative = {
        "method": "draft_model",
        "model": str(noisy_copy(model.path)),
        "num_speculative_tokens": 3,
        # Every step speculates: the back-off would sit out a case's rejections.
        "min_acceptance_rate": 0,
    }
    run = run_engine({**case, "speculative_config": speculative})
    for index, (got, plain, oracle) in enumerate(
        zip(run.tokens, run.plain_tokens, run.oracle_tokens, strict=True)
    ):
        first = _first_difference(got, oracle)
        assert got == oracle == plain, (
            f"request {index}: with the draft model, first difference from the recompute oracle at "
            f"output {first}: {got[first : first + 5]} vs {oracle[first : first + 5]}"
        )
    # Verdicts of both kinds are the llama and qwen3 cases' (gemma3-tiny's greedy answers do not
    # move with the noise: its draft is always right there).
    assert 0 < run.num_accepted <= run.num_drafted, f"{run.num_accepted} of {run.num_drafted} drafts accepted"
    if case["preset"] != "gemma3-tiny":
        assert run.num_accepted < run.num_drafted, "the noisy draft's drafts were never rejected"
    assert_no_kv_leak(run)


@functools.cache
def noisy_copy(folder: Path) -> Path:
    """The checkpoint in `folder` with Gaussian noise of 0.3 of each tensor's spread added: a
    draft model whose drafts are right where the target's choice is clear, wrong elsewhere."""
    noisy = Path(tempfile.mkdtemp(prefix="spec-decode-draft-"))
    atexit.register(shutil.rmtree, noisy, ignore_errors=True)
    for path in Path(folder).iterdir():
        shutil.copy(path, noisy / path.name)
    weights = safetensors.torch.load_file(Path(folder) / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, weight in weights.items():
        weights[name] = weight + 0.3 * weight.std() * torch.randn(weight.shape, generator=generator)
    safetensors.torch.save_file(weights, noisy / "model.safetensors", metadata={"format": "pt"})
    return noisy


def no_kv_leak(case: dict, impl: str | None) -> None:
    assert_no_kv_leak(engine_run(case))


def assert_no_kv_leak(run: EngineRun) -> None:
    # Rolled-back drafts' blocks stay the request's; a draft model also holds K positions of
    # lookahead wherever a step samples.
    speculative = SpeculativeConfig.from_dict(run.case["speculative_config"])
    lookahead = speculative.num_speculative_tokens if speculative.method == "draft_model" else 0
    block_size = run.block_size
    spare = math.ceil((run.num_speculative_tokens + lookahead) / block_size)
    assert run.leaked == [], f"blocks still lent once every request finished: {run.leaked}"
    if run.tree_blocks is None:
        assert run.num_used == 0, f"no prefix cache, yet {run.num_used} blocks are used at the end"
    else:
        assert run.num_used == run.tree_blocks, (
            f"{run.num_used} blocks used at the end, the prefix tree holds {run.tree_blocks}"
        )
        assert run.tree_locked == 0, f"{run.tree_locked} prefix-tree blocks still locked at the end"
    # Tokens whose K/V each live request has, tracked from the decisions and the verdicts alone.
    computed: dict[str, int] = {}
    kept_blocks_seen = False
    for log in run.steps:
        decision = log.decision
        step = decision.step
        for request_id in decision.finished_request_ids | decision.preempted_request_ids:
            computed.pop(request_id, None)
        for new in decision.new_requests:
            computed[new.request_id] = new.num_computed_tokens
        for running in decision.running_requests:
            assert running.num_computed_tokens == computed.get(running.request_id), (
                f"step {step}: {running.request_id} runs from num_computed_tokens "
                f"{running.num_computed_tokens}, but the previous verdicts left it "
                f"{computed.get(running.request_id)} (the rejected drafts rolled back wrong)"
            )
        for request_id, num_tokens in decision.num_scheduled_tokens.items():
            computed[request_id] += num_tokens
        for request_id in log.running_after:
            held = len(log.owned_after_schedule.get(request_id, []))
            needed = math.ceil(computed[request_id] / block_size)
            assert needed <= held <= needed + spare, (
                f"step {step}, after schedule(): {request_id} holds {held} blocks for "
                f"{computed[request_id]} computed and scheduled tokens ({needed} blocks of "
                f"{block_size}, at most {spare} more for rolled-back drafts and lookahead)"
            )
        for request_id, sampled in log.sampled.items():
            drafts = decision.spec_token_ids.get(request_id, ())
            if drafts and request_id in computed:
                computed[request_id] -= len(drafts) - (len(sampled) - 1)
        for request_id in log.finished:
            computed.pop(request_id, None)
            assert request_id not in log.owned_after_update, (
                f"step {step}: {request_id} finished and still holds blocks "
                f"{log.owned_after_update[request_id]}"
            )
        for request_id, num_computed in computed.items():
            held = len(log.owned_after_update.get(request_id, []))
            needed = math.ceil(num_computed / block_size)
            assert needed <= held <= needed + spare, (
                f"step {step}, after update(): {request_id} holds {held} blocks for {num_computed} "
                f"computed tokens ({needed} blocks of {block_size}, at most {spare} more for "
                "rolled-back drafts and lookahead)"
            )
            kept_blocks_seen |= held > needed
    assert kept_blocks_seen, "no request ever kept a rolled-back draft's block: the case does not test it"


def engine_run(case: dict) -> EngineRun:
    # Keyed without the id: SPEC-001 and SPEC-003 judge one run of the same case.
    return _engine_run(json.dumps({k: v for k, v in case.items() if k != "id"}, sort_keys=True))


@functools.cache
def _engine_run(case_json: str) -> EngineRun:
    return run_engine(json.loads(case_json))


def run_engine(case: dict, scheduler_class: type[Scheduler] | None = None) -> EngineRun:
    """The case with and without speculation, recorded; `scheduler_class` (a Scheduler subclass,
    for the checks' own tests) replaces the speculating engine's scheduler's class."""
    model, _ = _tiny_model(case["preset"])
    settings = {**ENGINE_BASE, **case["engine"]}
    prompts = _prompts(case, model)
    params = SamplingParams(temperature=0, max_new_tokens=case["max_new_tokens"], ignore_eos=True)
    baseline = {k: v for k, v in case.items() if k not in ("id", "speculative_config")}
    plain_tokens = [list(tokens) for tokens in _plain_tokens(json.dumps(baseline, sort_keys=True))]
    engine = Engine(
        EngineConfig(**settings, speculative_config=case["speculative_config"]), loaded_model=model
    )
    if scheduler_class is not None:
        engine.core.scheduler.__class__ = scheduler_class
    steps, num_cached = _spy(engine)
    tokens, all_prompts = _generate(engine, prompts, params, case.get("follow_up", False))
    scheduler, allocator = engine.core.scheduler, engine.core.kv_pool.allocator
    tree = engine.core.prefix_tree
    counts = scheduler.spec_decode_counts
    return EngineRun(
        case=case,
        block_size=settings["block_size"],
        num_speculative_tokens=SpeculativeConfig.from_dict(case["speculative_config"]).num_speculative_tokens,
        prompts=all_prompts,
        tokens=tokens,
        plain_tokens=plain_tokens,
        oracle_tokens=[
            _oracle_tokens(case["preset"], prompt, params.max_new_tokens) for prompt in all_prompts
        ],
        steps=steps,
        num_accepted=counts.num_accepted_tokens,
        num_drafted=counts.num_draft_tokens,
        num_preempted=scheduler.num_preempted,
        num_cached_tokens=sum(num_cached.values()),
        leaked=allocator.audit([TREE_OWNER]),
        num_used=allocator.num_used,
        tree_blocks=None if tree is None else len(allocator.owned_by(TREE_OWNER)),
        tree_locked=0 if tree is None else tree.num_locked_blocks,
    )


# SPEC-001's and SPEC-005's runs of a case (and the checks' own tests' runs of it with broken
# schedulers) differ only in the speculating engine: the run without speculation and the recompute
# oracle's tokens of a prompt are computed once per session.
@functools.cache
def _plain_tokens(case_json: str) -> list[list[int]]:
    """Every prompt's greedy tokens (both waves') from the case's engine without speculation."""
    case = json.loads(case_json)
    model, _ = _tiny_model(case["preset"])
    params = SamplingParams(temperature=0, max_new_tokens=case["max_new_tokens"], ignore_eos=True)
    plain = Engine(EngineConfig(**ENGINE_BASE, **case["engine"]), loaded_model=model)
    tokens, _ = _generate(plain, _prompts(case, model), params, case.get("follow_up", False))
    return tokens


def _oracle_tokens(preset: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    return list(_oracle_tokens_once(preset, tuple(prompt), max_new_tokens))


@functools.cache
def _oracle_tokens_once(preset: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    _, oracle = _tiny_model(preset)
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return tuple(oracle.generate(list(prompt), params).token_ids)


def _generate(engine: Engine, prompts, params, follow_up: bool):
    """Every prompt's greedy tokens; with follow_up, a second wave whose prompts continue each
    first-wave conversation (its prompt, its answer, 3 tokens more), after the first finished.
    Returns (tokens per prompt of both waves, those prompts)."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = run_to_completion(engine)
    tokens = [token_ids(outputs[request_id]) for request_id in ids]
    all_prompts = list(prompts)
    if follow_up:
        second = [prompt + answer + prompt[:3] for prompt, answer in zip(prompts, tokens, strict=True)]
        ids = [engine.add_request(prompt, params) for prompt in second]
        outputs = run_to_completion(engine)
        tokens += [token_ids(outputs[request_id]) for request_id in ids]
        all_prompts += second
    return tokens, all_prompts


def _spy(engine: Engine) -> tuple[list[StepLog], dict[str, int]]:
    """Records every schedule() and update() of the engine's scheduler (it calls them by
    attribute, so instance attributes wrapping the real methods see every call); also each
    request's prompt tokens served from the prefix cache."""
    scheduler = engine.core.scheduler
    allocator = engine.core.kv_pool.allocator
    schedule, update = scheduler.schedule, scheduler.update
    steps: list[StepLog] = []
    by_step: dict[int, StepLog] = {}
    num_cached: dict[str, int] = {}

    def spied_schedule():
        decision = schedule()
        log = StepLog(decision, [r.request_id for r in scheduler.running], _blocks_by_owner(allocator))
        steps.append(log)
        by_step[decision.step] = log
        return decision

    def spied_update(decision, runner_output: RunnerOutput):
        outputs = update(decision, runner_output)
        log = by_step[decision.step]
        log.sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True))
        log.finished = [output.request_id for output in outputs if output.finished]
        for output in outputs:
            num_cached[output.request_id] = max(
                num_cached.get(output.request_id, 0), output.num_cached_tokens
            )
        log.owned_after_update = _blocks_by_owner(allocator)
        return outputs

    scheduler.schedule, scheduler.update = spied_schedule, spied_update
    return steps, num_cached


def _accepted_per_row(log: StepLog) -> dict[str, int]:
    """Drafts each verified row of the step accepted (its sampled tokens but the target's one)."""
    return {
        request_id: len(log.sampled.get(request_id, ())) - 1
        for request_id in log.decision.spec_token_ids
        if log.sampled.get(request_id)
    }


def _prompts(case: dict, model) -> list[list[int]]:
    vocab_size = model.config.vocab_size
    rng = random.Random(f"{case['preset']}-prompts")
    looping = []
    for index in range(case["looping"]):
        start = [rng.randrange(1, vocab_size) for _ in range(5 + 7 * index)]
        looping.append(start + _oracle_tokens(case["preset"], start, 20))
    repeating = []
    for index in range(case["repeating"]):
        start = [rng.randrange(1, vocab_size) for _ in range(30 + 15 * index)]
        repeating.append(start + start[:10])
    return looping + repeating


@functools.cache
def _tiny_model(preset: str):
    """(LoadedModel, RecomputeOracle) of a random fp32 checkpoint, written once per session."""
    folder = Path(tempfile.mkdtemp(prefix=f"spec-decode-{preset}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model = load_model(make_random_checkpoint(preset, folder, dtype=torch.float32), dtype=torch.float32)
    return model, RecomputeOracle(model)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _blocks_by_owner(allocator) -> dict[str, list[int]]:
    owners: dict[str, list[int]] = defaultdict(list)
    for block in range(allocator.num_blocks):
        for owner in allocator.owners_of(block):
            owners[owner].append(block)
    return dict(owners)


# -- lossless (SPEC-002) --------------------------------------------------------------------


def lossless(case: dict, impl: str | None) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(case["vocab_size"] * 10 + case["max_drafts"])
        target, draft = make_case(case["kind"], case["vocab_size"], case["max_drafts"])
        outputs, num_drafts, acceptance = run_sampler(target, draft, case["num_trials"], "cpu")
    failures = lossless_failures(outputs, num_drafts, target, acceptance)
    assert not failures, "the emitted tokens are not the target's:\n" + "\n".join(failures)


# -- the scheduler with drafts (SPEC-004) ---------------------------------------------------

# Budgets of the scheduler cases, under the case's own keys.
SIM_DEFAULTS = dict(
    seed=0,
    max_batch_size=4,
    max_num_batched_tokens=64,
    kv_blocks=64,
    block_size=4,
    prefill_chunk_size=16,
    max_steps=2000,
)
# The runner's tokens cycle through LOOP_LENGTH ids (none a prompt token: arrivals_of draws
# those from 1_000_000 up), so a request's output soon repeats and the lookup finds it.
LOOP_LENGTH = 5


def token_at(position: int) -> int:
    return position % LOOP_LENGTH


class SpeculatingRunner:
    """The runner's side without a model: rows built from the decisions; a row that reaches its
    known tokens samples the token at its next position, and a speculating row accepts a
    seeded-random number of its drafts (no more than are right) and emits them and one more."""

    def __init__(self, seed: int):
        self.rng = random.Random(f"verdicts-{seed}")
        self.rows: dict[str, list[int]] = {}  # request id -> [known tokens, computed tokens]

    def execute(self, decision: ScheduleDecision) -> RunnerOutput:
        step = decision.step
        for request_id in decision.finished_request_ids | decision.preempted_request_ids:
            self.rows.pop(request_id, None)
        for new in decision.new_requests:
            self.rows[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        for running in decision.running_requests:
            row = self.rows[running.request_id]
            assert running.num_computed_tokens == row[1], (
                f"step {step}: {running.request_id} runs from num_computed_tokens "
                f"{running.num_computed_tokens}, the runner's row has {row[1]} tokens' K/V "
                "(the rejected drafts rolled back wrong)"
            )
        sampled = []
        for request_id, num_tokens in decision.num_scheduled_tokens.items():
            row = self.rows[request_id]
            drafts = decision.spec_token_ids.get(request_id, ())
            if drafts:
                assert row[1] + 1 == row[0] and num_tokens == 1 + len(drafts), (
                    f"step {step}: {request_id} speculates with {row[1]} of {row[0]} known tokens "
                    f"computed, {num_tokens} tokens for {len(drafts)} drafts; a speculating row "
                    "decodes its last known token, then its drafts"
                )
                right = next(
                    (j for j, token in enumerate(drafts) if token != token_at(row[0] + j)), len(drafts)
                )
                num_accepted = min(self.rng.randint(0, len(drafts)), right)
                emitted = tuple(token_at(row[0] + j) for j in range(num_accepted + 1))
                row[1] += 1 + num_accepted  # the rejected drafts' K/V is dropped
                row[0] += len(emitted)
                sampled.append(emitted)
                continue
            row[1] += num_tokens
            if row[1] >= row[0]:
                sampled.append((token_at(row[0]),))
                row[0] += 1
            else:
                sampled.append(())
        return RunnerOutput(tuple(decision.num_scheduled_tokens), tuple(sampled))


@dataclass
class SimStep:
    decision: ScheduleDecision
    num_running_before: int
    # Tokens each request had got from update() before this step.
    outputs_before: dict[str, int]


@dataclass
class DraftSimulation:
    case: dict
    speculative: SpeculativeConfig
    scheduler: Scheduler
    steps: list[SimStep]
    max_tokens: dict[str, int]  # per request
    outputs: dict[str, int]  # tokens each request got


def draft_budget(case: dict, impl: str | None) -> None:
    assert_draft_budget(simulate_drafts(case))


def simulate_drafts(case: dict, scheduler_class: type[Scheduler] = Scheduler) -> DraftSimulation:
    """Runs the case to the end with SpeculatingRunner; fails if requests remain after max_steps."""
    case = {**SIM_DEFAULTS, **case}
    speculative = SpeculativeConfig.from_dict(case["speculative_config"])
    allocator = BlockAllocator(case["kv_blocks"])
    tree = PrefixTree(allocator, case["block_size"]) if case.get("prefix_cache") else None
    limit = case.get("disable_by_batch_size")
    scheduler = scheduler_class(
        kv_manager=KVCacheManager(allocator, case["block_size"], tree),
        max_seq_len=case["kv_blocks"] * case["block_size"],
        max_batch_size=case["max_batch_size"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        use_chunked_prefill=True,
        prefill_chunk_size=case["prefill_chunk_size"],
        proposer=NgramProposer(
            speculative.num_speculative_tokens, speculative.prompt_lookup_min, speculative.prompt_lookup_max
        ),
        disable_speculation_above=limit,
    )
    arrivals = arrivals_of(case)
    runner = SpeculatingRunner(case["seed"])
    outputs: dict[str, int] = defaultdict(int)
    steps: list[SimStep] = []
    last_arrival = max(a.at_step for a in arrivals)
    for step in range(case["max_steps"]):
        for arrival in arrivals:
            if arrival.at_step == step:
                params = SamplingParams(temperature=0.0, max_new_tokens=arrival.max_tokens)
                scheduler.add(
                    Request(arrival.request_id, list(arrival.prompt_token_ids), params, arrival.index)
                )
        num_running = scheduler.num_running
        decision = scheduler.schedule()
        steps.append(SimStep(decision, num_running, dict(outputs)))
        for output in scheduler.update(decision, runner.execute(decision)):
            outputs[output.request_id] += len(output.new_token_ids)
        if step >= last_arrival and not scheduler.has_work():
            break
    else:
        raise AssertionError(f"requests still run after max_steps={case['max_steps']} steps")
    max_tokens = {a.request_id: a.max_tokens for a in arrivals}
    return DraftSimulation(case, speculative, scheduler, steps, max_tokens, dict(outputs))


def assert_draft_budget(sim: DraftSimulation) -> None:
    case, speculative, scheduler, max_tokens = sim.case, sim.speculative, sim.scheduler, sim.max_tokens
    outputs, limit = sim.outputs, sim.case.get("disable_by_batch_size")
    allocator = scheduler.kv_manager.allocator
    over_limit_seen = False
    for sim_step in sim.steps:
        decision = sim_step.decision
        step = decision.step
        total = decision.total_num_scheduled_tokens
        assert total <= case["max_num_batched_tokens"], (
            f"step {step}: {total} tokens scheduled ({sum(map(len, decision.spec_token_ids.values()))} "
            f"of them drafts), budget {case['max_num_batched_tokens']}"
        )
        for request_id, drafts in decision.spec_token_ids.items():
            assert 1 <= len(drafts) <= speculative.num_speculative_tokens, (
                f"step {step}: {request_id} verifies {len(drafts)} drafts, "
                f"K is {speculative.num_speculative_tokens}"
            )
            assert decision.num_scheduled_tokens[request_id] == 1 + len(drafts), (
                f"step {step}: {request_id} runs {decision.num_scheduled_tokens[request_id]} tokens "
                f"with {len(drafts)} drafts"
            )
            emitted_at_most = sim_step.outputs_before.get(request_id, 0) + len(drafts) + 1
            assert emitted_at_most <= max_tokens[request_id], (
                f"step {step}: {request_id} has {sim_step.outputs_before.get(request_id, 0)} tokens and "
                f"verifies {len(drafts)} drafts: up to {emitted_at_most}, past max_new_tokens "
                f"{max_tokens[request_id]}"
            )
        if limit is not None and sim_step.num_running_before > limit:
            assert not decision.spec_token_ids, (
                f"step {step} starts with {sim_step.num_running_before} running requests, above "
                f"disable_by_batch_size {limit}, and speculates for {sorted(decision.spec_token_ids)}"
            )
            over_limit_seen |= len(decision.num_scheduled_tokens) > 0
    for request_id, expected in max_tokens.items():
        assert outputs.get(request_id, 0) == expected, (
            f"{request_id} got {outputs.get(request_id, 0)} tokens, max_new_tokens {expected}"
        )
    counts = scheduler.spec_decode_counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, (
        f"{counts.num_accepted_tokens} of {counts.num_draft_tokens} drafts accepted: the case must "
        "accept some and reject some"
    )
    if limit is not None:
        assert over_limit_seen, f"no step started with more than {limit} running requests"
    if case.get("expect_preemption"):
        assert scheduler.num_preempted > 0, "the case is meant to preempt, and nothing was preempted"
    assert allocator.audit([TREE_OWNER]) == [], (
        f"blocks still lent at the end: {allocator.audit([TREE_OWNER])}"
    )
    if scheduler.kv_manager.prefix_tree is None:
        assert allocator.num_used == 0, f"{allocator.num_used} blocks used at the end"
