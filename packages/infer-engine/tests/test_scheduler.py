"""The Scheduler on hand-sized scenarios (no model): what each budget, policy and batching mode
promises, and the decisions the runner receives. The long adversarial runs are the conformance
suite, specs/scheduler (pytest conformance -k SCHED)."""

import pytest

from infer.cache import BlockAllocator, PrefixTree
from infer.engine.decision import RunnerOutput, ScheduleDecision
from infer.engine.kv_manager import KVCacheManager
from infer.engine.protocol import FinishReason
from infer.engine.request import QueueFullError, Request, RequestState, RequestTooLongError
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.spec_decode.backoff import PROBE_ROWS, SpeculationBackoff


def make_scheduler(*, num_blocks=64, block_size=16, **kwargs) -> Scheduler:
    settings = dict(max_seq_len=num_blocks * block_size, max_batch_size=4, max_num_batched_tokens=64)
    kv_manager = KVCacheManager(BlockAllocator(num_blocks), block_size)
    return Scheduler(kv_manager=kv_manager, **{**settings, **kwargs})


def request(request_id: str, prompt_tokens: int, max_new_tokens: int = 4, **params) -> Request:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **params)
    return Request(request_id, list(range(1, prompt_tokens + 1)), params)


def greedy_token(token_ids: list[int]) -> int:
    """A stand-in for a greedy model: the next token is a function of the whole context."""
    return sum(i * t for i, t in enumerate(token_ids, start=1)) % 1000


def run_step(scheduler: Scheduler) -> ScheduleDecision:
    """schedule(), a fake runner that samples `greedy_token` for every row that reaches its last
    known token, and update() (which finishes the requests that reached max_new_tokens)."""
    decision = scheduler.schedule()
    sampled = []
    for request_id in decision.num_scheduled_tokens:
        r = scheduler.get(request_id)
        # schedule() counts the step as run: it computed the last known token, or not.
        reaches_the_end = r.num_computed_tokens == len(r.all_token_ids)
        sampled.append((greedy_token(r.all_token_ids),) if reaches_the_end else ())
    scheduler.update(decision, RunnerOutput(tuple(decision.num_scheduled_tokens), tuple(sampled)))
    return decision


def run_until_decoding(scheduler: Scheduler, *requests: Request) -> None:
    """Adds `requests` and runs steps until each has its first token."""
    for r in requests:
        scheduler.add(r)
    for _ in range(1000):
        if all(r.output_ids for r in requests):
            return
        run_step(scheduler)
    raise AssertionError(f"not all of {requests} got a first token in 1000 steps")


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[ScheduleDecision]:
    decisions = []
    while scheduler.has_work():
        decisions.append(run_step(scheduler))
        assert len(decisions) < max_steps, "livelock"
    return decisions


# -- memory ---------------------------------------------------------------------------------


def test_blocks_are_taken_as_the_request_grows_not_for_max_new_tokens_up_front():
    scheduler = make_scheduler(block_size=16)
    r = request("r", 20, max_new_tokens=100)
    scheduler.add(r)
    first = run_step(scheduler)
    assert first.new_requests[0].block_ids == (0, 1)  # 20 prompt tokens: 2 blocks, not 8
    # Decoding feeds back one token a step; a block is added only when token 32 starts a new one.
    gains = {}
    while r.num_computed_tokens < 40:
        decision = run_step(scheduler)
        gains[decision.running_requests[0].num_computed_tokens] = decision.running_requests[0].new_block_ids
    assert {at: blocks for at, blocks in gains.items() if blocks} == {32: (2,)}
    assert scheduler.kv_manager.block_ids("r") == (0, 1, 2)


def test_a_new_request_carries_all_its_blocks_and_then_only_the_new_ones_are_sent():
    scheduler = make_scheduler(block_size=16)
    scheduler.add(request("r", 16, max_new_tokens=8, seed=7))
    first = run_step(scheduler)
    (new,) = first.new_requests
    assert (new.token_ids, new.num_prompt_tokens, new.num_computed_tokens) == (tuple(range(1, 17)), 16, 0)
    assert (new.block_ids, new.generator_seed) == ((0,), 7)
    assert first.num_scheduled_tokens == {"r": 16}
    second = run_step(scheduler)
    assert second.new_requests == ()
    assert second.running_requests[0].num_computed_tokens == 16
    assert second.running_requests[0].new_block_ids == (1,)  # token 16 opens block 1


def test_unseeded_requests_get_the_engine_seed_mixed_with_their_arrival_index():
    scheduler = make_scheduler(engine_seed=3)
    r = request("r", 4)
    r.arrival_index = 5
    scheduler.add(r)
    assert run_step(scheduler).new_requests[0].generator_seed == 3 * 1_000_003 + 5


def cached_scheduler() -> Scheduler:
    allocator = BlockAllocator(64)
    kv_manager = KVCacheManager(allocator, 16, PrefixTree(allocator, 16))
    return Scheduler(kv_manager=kv_manager, max_seq_len=1024, max_batch_size=4, max_num_batched_tokens=64)


def test_tokens_a_new_request_reuses_from_the_prefix_cache_count_as_computed_and_cached():
    scheduler = cached_scheduler()
    scheduler.add(request("first", 40))
    run_to_completion(scheduler)  # its 40 prompt tokens go to the tree
    second = request("second", 48)
    scheduler.add(second)
    decision = run_step(scheduler)
    (new,) = decision.new_requests
    # Two shared blocks and a copy of the 8 tokens the match ends inside: 8 tokens left to compute.
    assert (new.num_computed_tokens, second.num_cached_tokens) == (40, 40)
    assert decision.num_scheduled_tokens == {"second": 8}
    assert new.block_ids == scheduler.kv_manager.block_ids("second") and len(new.block_ids) == 3


def test_a_prefix_cache_hit_that_cannot_start_this_step_counts_nothing_until_it_does():
    scheduler = cached_scheduler()
    scheduler.add(request("first", 40))
    run_to_completion(scheduler)
    scheduler.add(Request("other", [7] * 40, SamplingParams(temperature=0.0, max_new_tokens=4)))
    late = request("late", 80)  # 40 tokens from the cache, 40 to compute: 24 are left of the budget
    scheduler.add(late)
    assert run_step(scheduler).num_scheduled_tokens == {"other": 40}
    assert (late.state, late.num_computed_tokens, late.num_cached_tokens) == (RequestState.WAITING, 0, 0)
    assert scheduler.kv_manager.block_ids("late") == ()
    decision = run_step(scheduler)
    assert decision.num_scheduled_tokens == {"other": 1, "late": 40}
    assert (decision.new_requests[0].num_computed_tokens, late.num_cached_tokens) == (40, 40)


# -- preemption -----------------------------------------------------------------------------


def test_the_most_recently_admitted_request_is_preempted_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=4, block_size=16, max_batch_size=2)
    old, recent = request("old", 16, max_new_tokens=40), request("recent", 16, max_new_tokens=40)
    run_until_decoding(scheduler, old, recent)
    scheduler.add(request("newcomer", 4))  # waits: old and recent take the pool's last 2 blocks
    while old.num_computed_tokens < 32:
        assert run_step(scheduler).preempted_request_ids == frozenset()
    decision = run_step(scheduler)  # old needs a third block for token 32
    assert decision.preempted_request_ids == {"recent"}
    assert decision.num_scheduled_tokens == {"old": 1}
    assert (recent.state, scheduler.kv_manager.block_ids("recent"), recent.num_computed_tokens) == (
        RequestState.PREEMPTED,
        (),
        0,
    )
    assert recent.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["recent", "newcomer"]  # ahead of the newcomer


def test_a_preempted_request_resumes_as_a_new_request_with_prompt_plus_outputs():
    scheduler = make_scheduler(num_blocks=4, block_size=16, max_batch_size=2)
    old, recent = request("old", 16, max_new_tokens=20), request("recent", 16, max_new_tokens=40)
    run_until_decoding(scheduler, old, recent)
    while recent.state is not RequestState.PREEMPTED:
        run_step(scheduler)
    generated = list(recent.output_ids)
    while recent.state is not RequestState.RUNNING:
        decision = run_step(scheduler)
    (resumed,) = decision.new_requests
    assert resumed.token_ids == tuple(recent.prompt_ids + generated)
    assert (resumed.num_prompt_tokens, resumed.num_computed_tokens) == (16, 0)
    # The whole recompute runs in one step, and its last position samples the next token.
    assert decision.num_scheduled_tokens["recent"] == 16 + len(generated)
    assert len(recent.output_ids) == len(generated) + 1


def test_greedy_outputs_are_the_same_whether_or_not_requests_were_preempted():
    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=16, max_batch_size=3)
        requests = [request(f"r{i}", 10 + 7 * i, max_new_tokens=50) for i in range(3)]
        for r in requests:
            scheduler.add(r)
        run_to_completion(scheduler)
        return {r.request_id: r.output_ids for r in requests}, sum(r.num_preemptions for r in requests)

    roomy, no_preemptions = outputs(num_blocks=64)
    tight, preemptions = outputs(num_blocks=6)
    assert (no_preemptions, preemptions > 0) == (0, True)
    assert tight == roomy


def test_a_request_that_is_itself_the_most_recent_preempts_itself():
    # prefill_first serves the newest request's prompt chunk before the older one's decode.
    scheduler = make_scheduler(
        num_blocks=3,
        block_size=16,
        policy="prefill_first",
        decode_service_interval=4,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
    )
    old = request("old", 16, max_new_tokens=20)
    run_until_decoding(scheduler, old)
    scheduler.add(request("long", 40, max_new_tokens=2))
    run_step(scheduler)  # long takes 1 block for its first chunk, old keeps 2
    decision = run_step(scheduler)  # long's second chunk finds no block: long is the most recent
    assert decision.preempted_request_ids == {"long"}
    assert list(decision.num_scheduled_tokens) == ["old"]  # served after long gave its block back


# -- retiring -------------------------------------------------------------------------------


def test_a_finished_request_is_reported_once_in_the_next_decision():
    scheduler = make_scheduler()
    scheduler.add(request("short", 4, max_new_tokens=1))
    scheduler.add(request("long", 4, max_new_tokens=5))
    first = run_step(scheduler)  # short gets its one token and is finished
    assert first.finished_request_ids == frozenset()
    assert run_step(scheduler).finished_request_ids == {"short"}
    assert run_step(scheduler).finished_request_ids == frozenset()


def test_finish_frees_a_running_request_and_forgets_a_waiting_one_without_reporting_it():
    scheduler = make_scheduler(num_blocks=4, max_batch_size=1)
    run_until_decoding(scheduler, request("running", 20, max_new_tokens=40))
    scheduler.add(request("queued", 4))
    assert scheduler.finish("queued").request_id == "queued"
    scheduler.finish("running")
    assert scheduler.kv_manager.num_free_blocks == 4
    assert scheduler.finish("running") is None
    assert scheduler.schedule().finished_request_ids == {"running"}
    assert not scheduler.has_work()


def test_update_returns_tokens_only_for_rows_that_reached_their_last_known_token():
    scheduler = make_scheduler(use_chunked_prefill=True, prefill_chunk_size=32)
    scheduler.add(request("long", 40))
    scheduler.add(request("short", 8))
    decision = scheduler.schedule()
    assert decision.num_scheduled_tokens == {"long": 32, "short": 8}
    outputs = scheduler.update(decision, RunnerOutput(("long", "short"), ((), (7,))))
    assert [(output.request_id, output.new_token_ids) for output in outputs] == [("short", [7])]
    assert scheduler.get("long").num_computed_tokens == 32


def test_update_ends_a_request_on_its_stop_token_once_min_tokens_are_out_and_at_max_tokens():
    """The token rules (the spec: OpenAI's stop ids count once min_tokens are out; max_tokens
    ends at length), applied by update itself: the request is finished and its blocks freed."""
    scheduler = make_scheduler(num_blocks=8)
    stopper = request("stopper", 4, max_new_tokens=10, min_tokens=1)
    stopper.stop_token_ids = frozenset({5})
    scheduler.add(stopper)
    scheduler.add(request("counter", 4, max_new_tokens=2))
    steps = []
    for sampled in [(5, 9), (5, 9)]:  # the first 5 is within min_tokens: it does not stop
        decision = scheduler.schedule()
        outputs = scheduler.update(
            decision, RunnerOutput(tuple(decision.num_scheduled_tokens), ((sampled[0],), (sampled[1],)))
        )
        steps.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs])
    assert steps == [
        [("stopper", [5], None), ("counter", [9], None)],
        [("stopper", [5], FinishReason.STOP), ("counter", [9], FinishReason.LENGTH)],
    ]
    assert not scheduler.has_work() and scheduler.kv_manager.num_free_blocks == 8
    assert scheduler.schedule().finished_request_ids == {"stopper", "counter"}


def test_update_refuses_a_token_sampled_in_the_middle_of_a_prompt():
    scheduler = make_scheduler(use_chunked_prefill=True, prefill_chunk_size=32)
    scheduler.add(request("long", 40))
    decision = scheduler.schedule()
    with pytest.raises(ValueError, match="samples only once its last known token is computed"):
        scheduler.update(decision, RunnerOutput(("long",), ((7,),)))


# -- prefill --------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_prompt_by_chunk_size_and_the_step_budget():
    scheduler = make_scheduler(use_chunked_prefill=True, prefill_chunk_size=48, max_num_batched_tokens=64)
    scheduler.add(request("long", 150))
    scheduler.add(request("next", 30))
    steps = [run_step(scheduler).num_scheduled_tokens for _ in range(4)]
    assert steps[0] == {"long": 48, "next": 16}  # next takes what long's chunk leaves
    assert steps[1] == {"long": 48, "next": 14}
    assert steps[2] == {"long": 48, "next": 1}
    assert steps[3] == {"long": 6, "next": 1}


def test_chunked_prefill_caps_the_prefill_rows_of_a_step():
    scheduler = make_scheduler(use_chunked_prefill=True, prefill_chunk_size=16, max_prefill_chunks_per_step=2)
    for i in range(3):
        scheduler.add(request(f"r{i}", 40))
    assert run_step(scheduler).num_scheduled_tokens == {"r0": 16, "r1": 16}


def test_without_chunking_a_prompt_runs_whole_or_waits_for_a_step_that_holds_it():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add(request("a", 40))
    scheduler.add(request("b", 40))
    assert run_step(scheduler).num_scheduled_tokens == {"a": 40}
    assert run_step(scheduler).num_scheduled_tokens == {"a": 1, "b": 40}


def test_without_chunking_a_prompt_longer_than_the_budget_runs_alone_among_prefills():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add(request("short", 30))
    scheduler.add(request("huge", 200))
    assert run_step(scheduler).num_scheduled_tokens == {"short": 30}  # another prefill is in this step
    decision = run_step(scheduler)
    assert decision.num_scheduled_tokens == {"short": 1, "huge": 200}
    assert decision.total_num_scheduled_tokens == 201


# -- policies and admission -----------------------------------------------------------------


def test_fcfs_serves_running_requests_in_admission_order():
    scheduler = make_scheduler(policy="fcfs", max_num_batched_tokens=16, use_chunked_prefill=True)
    run_until_decoding(scheduler, request("early", 4, max_new_tokens=50))
    scheduler.add(request("late", 100))
    assert list(run_step(scheduler).num_scheduled_tokens.items()) == [("early", 1), ("late", 15)]


def test_prefill_first_defers_decodes_until_they_fall_due():
    scheduler = make_scheduler(
        policy="prefill_first", max_num_batched_tokens=16, decode_service_interval=3, use_chunked_prefill=True
    )
    run_until_decoding(scheduler, request("decoder", 4, max_new_tokens=50))
    scheduler.add(request("prompt", 200))
    decode_steps = [step for step in range(9) if "decoder" in run_step(scheduler).num_scheduled_tokens]
    # The prompt takes every whole budget; the decoder is served exactly when 3 steps old.
    assert decode_steps == [2, 5, 8]


def test_decode_round_robin_decodes_everyone_before_any_prefill_and_rotates():
    scheduler = make_scheduler(
        policy="decode_round_robin",
        max_num_batched_tokens=16,
        decode_service_interval=4,
        use_chunked_prefill=True,
    )
    run_until_decoding(scheduler, *(request(f"d{i}", 4, max_new_tokens=50) for i in range(3)))
    scheduler.add(request("prompt", 200))
    first, second = (list(run_step(scheduler).num_scheduled_tokens.items()) for _ in range(2))
    assert sorted(first[:3]) == sorted(second[:3]) == [("d0", 1), ("d1", 1), ("d2", 1)]
    assert first[:3] != second[:3]  # rotated
    assert first[3] == ("prompt", 16 - 3)


def test_admission_is_first_come_first_served_even_when_a_later_request_would_fit():
    scheduler = make_scheduler(num_blocks=4, block_size=16, max_batch_size=3)
    run_until_decoding(scheduler, request("holder", 40, max_new_tokens=2))  # 3 of 4 blocks
    scheduler.add(request("big", 20))  # needs 2 blocks: waits
    scheduler.add(request("small", 4))  # would fit in the free block, but is behind big
    assert run_step(scheduler).new_requests == ()  # holder's last token finishes it
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    assert [new.request_id for new in run_step(scheduler).new_requests] == ["big", "small"]


def test_static_batches_admit_a_whole_batch_and_nothing_until_it_has_left():
    scheduler = make_scheduler(static_batches=True, max_batch_size=2, max_num_batched_tokens=8)
    for i in range(3):
        scheduler.add(request(f"r{i}", 6, max_new_tokens=2))
    assert run_step(scheduler).num_scheduled_tokens == {"r0": 6}  # r1 is admitted but its prompt waits
    assert [r.request_id for r in scheduler.running] == ["r0", "r1"]
    while scheduler.get("r0") or scheduler.get("r1"):
        assert "r2" not in run_step(scheduler).num_scheduled_tokens
    assert [new.request_id for new in run_step(scheduler).new_requests] == ["r2"]


# -- speculation back-off ------------------------------------------------------------------


def run_drafting_step(scheduler: Scheduler) -> ScheduleDecision:
    """run_step with a draft model that never guesses right: each request the decision names
    in draft_request_ids gets drafts after it samples, and the target keeps none of them."""
    decision = scheduler.schedule()
    sampled, drafts = [], {}
    for request_id in decision.num_scheduled_tokens:
        r = scheduler.get(request_id)
        reaches_the_end = r.num_computed_tokens - r.num_draft_tokens == len(r.all_token_ids)
        sampled.append((greedy_token(r.all_token_ids),) if reaches_the_end else ())
        if reaches_the_end and request_id in (decision.draft_request_ids or ()):
            drafts[request_id] = (1, 2)
    outputs = RunnerOutput(tuple(decision.num_scheduled_tokens), tuple(sampled), spec_token_ids=drafts)
    scheduler.update(decision, outputs)
    return decision


def test_a_probe_drafts_for_the_requests_with_the_fewest_tokens_the_draft_has_not_seen():
    """While backed off, the draft model drafts for PROBE_ROWS requests: it catches up on each
    one's unseen tokens first, so the probe takes those with the fewest, not the oldest."""
    scheduler = make_scheduler(
        max_batch_size=8,
        max_num_batched_tokens=256,
        speculation_backoff=SpeculationBackoff(0.3),
        num_lookahead_tokens=2,
    )
    assert PROBE_ROWS == 2
    old_long, short, old_mid, shorter = (
        request("old-long", 120, 200),
        request("short", 50, 200),
        request("old-mid", 100, 200),
        request("shorter", 45, 200),
    )
    run_until_decoding(scheduler, old_long, short, old_mid, shorter)
    decision = run_drafting_step(scheduler)  # before the first verdict: a probe
    assert decision.draft_request_ids == {"short", "shorter"}
    # Verdicts of 0 back it off; later probes keep to the requests the draft has seen lately
    # (at most an interval's tokens behind) over a new one shorter than both but unseen.
    newcomer = request("newcomer", 24, 200)
    scheduler.add(newcomer)
    probes = []
    for _ in range(40):
        if drafted := run_drafting_step(scheduler).draft_request_ids:
            probes.append(drafted)
    assert len(probes) >= 2 and all(probe == {"short", "shorter"} for probe in probes), probes
    assert newcomer.num_tokens > 20 and scheduler.speculation_backoff.interval > 1


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_tokens", "max_new_tokens", "limit"),
    [(120, 10, "max_seq_len \\(128\\)"), (60, 20, "needs 3 KV blocks of 32 tokens but the whole pool has 2")],
)
def test_requests_that_can_never_fit_are_rejected_naming_the_limit(prompt_tokens, max_new_tokens, limit):
    scheduler = make_scheduler(num_blocks=2, block_size=32, max_seq_len=128)
    with pytest.raises(RequestTooLongError, match=limit):
        scheduler.add(request("too-long", prompt_tokens, max_new_tokens))
    assert not scheduler.has_work()


def test_queue_limit_duplicates_and_empty_prompts_are_refused():
    scheduler = make_scheduler(max_queue_len=1)
    scheduler.add(request("a", 4))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add(request("a", 4))
    with pytest.raises(QueueFullError, match="max_queue_len is 1"):
        scheduler.add(request("b", 4))
    with pytest.raises(ValueError, match="empty prompt"):
        make_scheduler().add(request("empty", 0))
