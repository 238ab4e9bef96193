"""The Scheduler on hand-sized scenarios (no model): what each policy and batching mode promises.
The long adversarial runs are the conformance suite, specs/scheduler (pytest conformance -k SCHED)."""

import pytest

from infer.cache import SlotAllocator
from infer.engine.request import QueueFullError, Request, RequestState, RequestTooLongError
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler


def make_scheduler(*, num_blocks=8, block_size=64, **kwargs) -> Scheduler:
    settings = dict(max_seq_len=num_blocks * block_size, max_num_seqs=4, max_num_batched_tokens=64)
    return Scheduler(kv_pool=SlotAllocator(num_blocks), kv_block_size=block_size, **{**settings, **kwargs})


def request(request_id: str, prompt_tokens: int, max_new_tokens: int = 4) -> Request:
    return Request(
        request_id, [1] * prompt_tokens, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    )


def run_step(scheduler: Scheduler, finished=()):
    decision = scheduler.schedule()
    scheduler.update(decision, finished=finished)
    return decision


def start_decoding(scheduler: Scheduler, *requests: Request) -> None:
    """Admits and prefills `requests` (short prompts), so that they all decode from the next step."""
    for r in requests:
        scheduler.add(r)
    for _ in range(1000):
        if all(r.state is RequestState.DECODE for r in requests):
            return
        run_step(scheduler)
    raise AssertionError(f"not all of {requests} reached DECODE in 1000 steps")


def test_long_prompt_is_prefilled_in_budget_sized_chunks_that_sum_to_it():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add(request("long", 150))
    chunks = [run_step(scheduler).prefills[0] for _ in range(3)]
    assert [(c.start, c.num_tokens) for c in chunks] == [(0, 64), (64, 64), (128, 22)]
    assert [c.completes_prompt for c in chunks] == [False, False, True]
    assert scheduler.get("long").state is RequestState.DECODE


def test_fcfs_serves_running_requests_in_admission_order():
    scheduler = make_scheduler(policy="fcfs", max_num_batched_tokens=16)
    start_decoding(scheduler, request("early", 4, max_new_tokens=50))
    scheduler.add(request("late", 100))
    run_step(scheduler)  # late is admitted and gets the budget early's decode leaves
    decision = scheduler.schedule()
    assert decision.decodes == ("early",)
    assert [(c.request_id, c.num_tokens) for c in decision.prefills] == [("late", 15)]


def test_prefill_first_defers_decodes_until_they_fall_due():
    scheduler = make_scheduler(policy="prefill_first", max_num_batched_tokens=16, decode_service_interval=3)
    start_decoding(scheduler, request("decoder", 4, max_new_tokens=50))
    scheduler.add(request("prompt", 200))
    decode_steps = [step for step in range(9) if run_step(scheduler).decodes]
    # The prompt takes every whole budget; the decoder is served exactly when 3 steps old.
    assert decode_steps == [2, 5, 8]


def test_decode_round_robin_decodes_everyone_before_any_prefill_and_rotates():
    scheduler = make_scheduler(
        policy="decode_round_robin", max_num_batched_tokens=16, decode_service_interval=4
    )
    start_decoding(scheduler, *(request(f"d{i}", 4, max_new_tokens=50) for i in range(3)))
    scheduler.add(request("prompt", 200))
    first, second = scheduler.schedule(), None
    scheduler.update(first)
    second = scheduler.schedule()
    assert sorted(first.decodes) == sorted(second.decodes) == ["d0", "d1", "d2"]
    assert first.decodes != second.decodes  # rotated
    assert first.prefills[0].num_tokens == 16 - 3


def test_a_decoder_left_out_by_the_budget_is_served_within_the_interval():
    # Four decoders and a prompt compete for 4 tokens a step under fcfs (prompt admitted first).
    scheduler = make_scheduler(
        policy="fcfs", num_blocks=16, max_num_batched_tokens=4, decode_service_interval=2
    )
    scheduler.add(request("prompt", 400))
    run_step(scheduler)
    start_decoding(scheduler, *(request(f"d{i}", 1, max_new_tokens=50) for i in range(3)))
    last_served = {}
    for _ in range(30):
        decision = run_step(scheduler)
        for request_id in decision.decodes:
            assert decision.step - last_served.get(request_id, decision.step - 1) <= 2
            last_served[request_id] = decision.step


def test_admission_is_first_come_first_served_even_when_a_later_request_would_fit():
    scheduler = make_scheduler(num_blocks=4, block_size=32)
    start_decoding(scheduler, request("holder", 60, max_new_tokens=30))  # 3 of 4 blocks
    scheduler.add(request("big", 40, max_new_tokens=20))  # needs 2 blocks: waits
    scheduler.add(request("small", 4))  # would fit in the free block, but is behind big
    assert run_step(scheduler).admitted == ()
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    run_step(scheduler, finished=["holder"])
    assert run_step(scheduler).admitted == ("big", "small")


def test_static_batches_admit_a_whole_batch_and_nothing_until_it_has_left():
    scheduler = make_scheduler(static_batches=True, max_num_seqs=2, max_num_batched_tokens=8)
    for i in range(3):
        scheduler.add(request(f"r{i}", 10))
    first = run_step(scheduler)
    assert first.admitted == ("r0", "r1")  # admitted together although only r0's chunk fits the budget
    run_step(scheduler, finished=["r0"])
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    while scheduler.get("r1").state is not RequestState.DECODE:
        assert run_step(scheduler).admitted == ()
    run_step(scheduler, finished=["r1"])
    assert run_step(scheduler).admitted == ("r2",)


def test_remove_frees_a_running_request_blocks_and_forgets_a_waiting_one():
    scheduler = make_scheduler(num_blocks=2, block_size=64, max_num_seqs=2)
    start_decoding(scheduler, request("a", 4, max_new_tokens=40), request("b", 4))
    scheduler.add(request("queued", 4))
    assert scheduler.kv_pool.num_free == 0
    assert scheduler.remove("queued").request_id == "queued"
    scheduler.remove("a")
    assert scheduler.kv_pool.num_free == 2 - 1
    assert scheduler.kv_pool.audit(["b"]) == []
    assert scheduler.remove("a") is None
    assert [r.request_id for r in scheduler.running] == ["b"]


@pytest.mark.parametrize(
    ("prompt_tokens", "max_new_tokens", "limit"),
    [(120, 10, "max_seq_len \\(128\\)"), (60, 20, "the whole pool has 2")],
)
def test_requests_that_can_never_fit_are_rejected_naming_the_limit(prompt_tokens, max_new_tokens, limit):
    scheduler = Scheduler(
        kv_pool=SlotAllocator(2), kv_block_size=32, max_seq_len=128, max_num_seqs=2, max_num_batched_tokens=64
    )
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
