"""Data parallelism (infer.engine.data_parallel): the prefix router against a brute-force
oracle, the replicas' summed statistics, and two CPU replicas behind one Engine: the greedy
tokens of one core, a conversation's next turn routed to the replica that holds its history (a
prefix-cache hit there), and a replica that dies failing only its own requests."""

import dataclasses
import os
import signal
import time
from collections import defaultdict

import pytest

from conformance.engine_runs import run_until_finished, token_ids
from conformance.parallel.checks import router_oracle
from infer.engine.client import EngineDeadError
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.data_parallel import (
    BALANCE_ABS_THRESHOLD,
    ROUTED_BLOCKS,
    PrefixRouter,
    replica_environment,
    sum_stats,
)
from infer.engine.engine import Engine
from infer.engine.protocol import EngineStats
from infer.engine.sampling_params import SamplingParams

from .test_engine import random_prompts
from .test_tensor_parallel_engine import SETTINGS as TENSOR_PARALLEL_SETTINGS

SETTINGS = dict(TENSOR_PARALLEL_SETTINGS, device="cpu")  # small blocks, chunked, prefix cache
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


# -- the router -------------------------------------------------------------------------------


def test_a_request_goes_to_the_least_busy_replica_sent_its_longest_prefix_else_the_least_busy():
    """specs/parallel DIST-002's brute-force oracle (conformance.parallel.checks.router_oracle) on
    400 requests over 3 replicas, a quarter or more of them placed by their prefix."""
    num_by_prefix = router_oracle({"replicas": 3, "block_size": 4, "requests": 400, "seed": 0}, None)
    assert num_by_prefix > 100


def test_a_much_busier_replica_loses_its_prefixes_to_the_least_busy():
    router = PrefixRouter(2, block_size=4)
    prompt = list(range(1, 30))
    assert router.route(prompt) == 0
    # A prefix of at most half the prompt does not decide: the least busy takes it.
    assert router.route(prompt[:12] + list(range(100, 113))) == 1
    router.loads = [0, 0]
    # Busier by the threshold exactly: the prefix still decides.
    router.loads = [BALANCE_ABS_THRESHOLD, 0]
    assert router.route(prompt + [7]) == 0
    # Busier by more than it, and more than 1.5 times: the least busy takes it.
    router.loads = [BALANCE_ABS_THRESHOLD + 2, 1]
    assert router.route(prompt + [8]) == 1
    # A replica that failed is never chosen, whatever it holds.
    router.alive[1] = False
    router.loads = [100, 0]
    assert router.route(prompt) == 0
    router.alive[0] = False
    with pytest.raises(EngineDeadError):
        router.route(prompt)


def test_a_conversation_longer_than_the_hashed_blocks_still_goes_where_it_went():
    router = PrefixRouter(2, block_size=4)
    history = list(range(1, ROUTED_BLOCKS * 4 + 1))
    first = router.route(history)
    router.finished(first)
    router.loads[first] = 2  # busier, but not by more than the balance threshold
    assert router.route(history * 3) == first  # 3x the hashed part: judged by that part


def test_round_robin_takes_the_replicas_in_turn_whatever_the_prompts_share():
    router = PrefixRouter(3, block_size=4, policy="round_robin")
    prompt = list(range(1, 30))
    assert [router.route(prompt) for _ in range(5)] == [0, 1, 2, 0, 1]
    router.alive[2] = False
    assert [router.route(prompt) for _ in range(3)] == [0, 1, 0]
    assert router.num_prefix_routed == 0


def test_each_replica_sees_its_own_gpus():
    config = EngineConfig(device="cuda", tensor_parallel_size=2, data_parallel_size=2)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    assert [replica_environment(config, r) for r in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    os.environ["CUDA_VISIBLE_DEVICES"] = "4,5,6,7"
    try:
        assert replica_environment(config, 1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    assert replica_environment(dataclasses.replace(config, device="cpu"), 1) == {}


def test_data_parallel_settings_that_cannot_work_are_refused_by_name():
    with pytest.raises(EngineConfigError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(EngineConfigError, match="device='cuda:1'"):
        EngineConfig(device="cuda:1", data_parallel_size=2)
    with pytest.raises(EngineConfigError, match="nnodes"):
        EngineConfig(data_parallel_size=2, nnodes=2, tensor_parallel_size=2, master_port=29500)
    with pytest.raises(EngineConfigError, match="data_parallel_routing"):
        EngineConfig(data_parallel_routing="random")
    with pytest.raises(EngineConfigError, match="process of its own"):
        Engine(EngineConfig(data_parallel_size=2, device="cpu"))


def test_the_replicas_statistics_add_up():
    def stats(**values) -> EngineStats:
        base = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING}
        return EngineStats(**{**base, **values})

    one = stats(
        num_running=2,
        kv_bytes_used=100,
        kv_bytes_total=1000,
        num_finished=5,
        prefix_cache_matches={"miss": 3, "prefix": 1},
        spec_decode_accepted_by_position=(4, 2),
        spec_decode_num_speculative_tokens=2,
        memory_device="cpu",
        decode_time_s_total=2.0,
        kv_cache_dtype="float8_e4m3fn",
        kv_tokens_total=64,
    )
    two = stats(
        num_running=1,
        kv_bytes_used=300,
        kv_bytes_total=1000,
        num_finished=7,
        prefix_cache_matches={"miss": 1, "lcp": 2},
        spec_decode_accepted_by_position=(1, 1),
        spec_decode_num_speculative_tokens=2,
        memory_device="cpu",
        decode_time_s_total=4.0,
        kv_cache_dtype="float8_e4m3fn",
        kv_tokens_total=32,
    )
    total = sum_stats([one, two])
    assert (total.num_running, total.num_finished, total.kv_bytes_used) == (3, 12, 400)
    assert total.kv_usage_ratio == 0.2
    assert (total.kv_cache_dtype, total.kv_tokens_total) == ("float8_e4m3fn", 96)
    assert total.prefix_cache_matches == {"miss": 4, "prefix": 1, "lcp": 2}
    assert total.spec_decode_accepted_by_position == (5, 3) and total.spec_decode_num_speculative_tokens == 2
    assert total.memory_device == "cpu" and total.decode_time_s_total == 3.0


# -- two replicas on the CPU --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_replicas(tiny_checkpoints):
    engine = Engine.spawn(
        EngineConfig(model=str(tiny_checkpoints["llama-tiny"]), data_parallel_size=2, **SETTINGS)
    )
    yield engine
    engine.shutdown()


def test_two_replicas_give_the_greedy_tokens_of_one_core(two_replicas, tiny_models):
    oracle = tiny_models["llama-tiny"].oracle
    prompts = random_prompts([30, 7, 45, 12, 25, 33], 384, seed=4)
    ids = [two_replicas.add_request(prompt, GREEDY) for prompt in prompts]
    outputs = run_until_finished(two_replicas, ids, timeout_s=120)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert token_ids(outputs[request_id]) == oracle.generate(prompt, GREEDY).token_ids
    # Unrelated prompts spread over both replicas; every one finished, and the sum says so.
    per_replica = [stats.num_finished for stats in two_replicas.replica_stats()]
    assert min(per_replica) > 0 and two_replicas.stats().num_finished == sum(per_replica)


def test_a_conversations_next_turn_finds_its_history_on_the_replica_that_ran_it(two_replicas):
    """Each turn's prompt is the previous prompt, its answer and a new message; the router sends
    it where the previous turn ran, so that replica's prefix cache serves the history. A few
    conversations at once, so that the least-busy fallback alone would mix them up."""
    conversations = random_prompts([40, 37, 45, 50], 384, seed=9)
    replica_of: dict[int, set[int]] = defaultdict(set)
    cached = 0
    for turn in range(3):
        ids = [two_replicas.add_request(prompt, GREEDY) for prompt in conversations]
        for index, request_id in enumerate(ids):
            replica_of[index].add(two_replicas.client._routed[request_id][0])
        outputs = run_until_finished(two_replicas, ids, timeout_s=120)
        for index, request_id in enumerate(ids):
            answer = token_ids(outputs[request_id])
            if turn:
                cached += max(output.cached_tokens for output in outputs[request_id])
            conversations[index] = (
                conversations[index] + answer + random_prompts([5], 384, seed=turn * 10 + index)[0]
            )
    assert all(len(replicas) == 1 for replicas in replica_of.values()), replica_of
    assert len({next(iter(r)) for r in replica_of.values()}) == 2  # both replicas hold some
    # Turns 2 and 3 reuse at least their previous prompt's whole blocks.
    assert cached >= 2 * sum(len(c) - 12 - 5 for c in conversations) // 2


def test_a_replica_that_dies_fails_its_own_requests_and_the_other_serves_on(tiny_checkpoints, tiny_models):
    engine = Engine.spawn(
        EngineConfig(model=str(tiny_checkpoints["llama-tiny"]), data_parallel_size=2, **SETTINGS)
    )
    try:
        slow = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
        prompts = random_prompts([20, 21, 22, 23], 384, seed=6)
        ids = [engine.add_request(prompt, slow) for prompt in prompts]
        victims = {rid for rid in ids if engine.client._routed[rid][0] == 1}
        assert victims and len(victims) < len(ids)
        os.kill(engine.client.replicas[1].process.pid, signal.SIGKILL)
        outputs = run_until_finished(engine, ids, timeout_s=120)
        for request_id in ids:
            final = outputs[request_id][-1]
            if request_id in victims:
                assert final.finished and final.error is not None and "replica 1" in final.error, final
            else:
                assert final.finish_reason == "length" and len(token_ids(outputs[request_id])) == 100
        assert engine.replicas_alive() == [True, False]
        # New requests go to the replica left, whatever they share with the dead one's.
        prompt = prompts[ids.index(next(iter(victims)))]
        request_id = engine.add_request(prompt, GREEDY)
        outputs = run_until_finished(engine, [request_id], timeout_s=120)
        assert (
            token_ids(outputs[request_id])
            == tiny_models["llama-tiny"].oracle.generate(prompt, GREEDY).token_ids
        )
        os.kill(engine.client.replicas[0].process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="every data-parallel replica failed"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                engine.step(wait_s=0.2)
    finally:
        engine.shutdown()
