"""Checks for specs/parallel: tensor and data parallelism change nothing but speed and placement.

DIST-001 and DIST-003 run real engines on the CPU (a tensor-parallel worker process over gloo; two
engine processes behind a DataParallelClient) over a tiny random fp32 checkpoint, and compare
each request's greedy tokens with the recompute oracle over the unsharded model. DIST-002 drives
the router alone against a brute-force oracle.
"""

import atexit
import functools
import random
import shutil
import tempfile
from pathlib import Path

import torch

from conformance.engine_runs import run_until_finished, token_ids
from conformance.oracles import RecomputeOracle, reference_8bit_linears
from infer.engine.config import EngineConfig
from infer.engine.data_parallel import BALANCE_ABS_THRESHOLD, CACHE_THRESHOLD, ROUTED_BLOCKS, PrefixRouter
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

ENGINE_BASE = dict(device="cpu", max_batch_size=4, max_seq_len=160)
PROMPT_LENGTHS = (30, 7, 45, 21)


@functools.cache
def _checkpoint(preset: str, quantization: str | None) -> tuple[Path, RecomputeOracle]:
    """A random fp32 checkpoint, written once per session, and the oracle over it unsharded."""
    folder = Path(tempfile.mkdtemp(prefix=f"parallel-{preset}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    make_random_checkpoint(preset, folder, dtype=torch.float32, quantization=quantization)
    model = load_model(folder, dtype=torch.float32)
    reference_8bit_linears(model.model)  # the shards are compared with the reference path
    return folder, RecomputeOracle(model)


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return prompts + [prompts[0][:20] + prompts[1]]  # shares a prefix with the first


def _run(engine: Engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = run_until_finished(engine, ids)
    for request_id in ids:
        assert all(output.error is None for output in outputs[request_id]), outputs[request_id][-1].error
    return [token_ids(outputs[request_id]) for request_id in ids]


def _assert_oracle_tokens(tokens, prompts, oracle: RecomputeOracle, params, label: str) -> None:
    for index, (got, prompt) in enumerate(zip(tokens, prompts, strict=True)):
        expected = oracle.generate(prompt, params).token_ids
        assert got == expected, f"{label}, request {index}: {got} against the oracle's {expected}"


def tensor_parallel_greedy(case: dict, impl: str | None) -> None:
    folder, oracle = _checkpoint(case["preset"], case.get("quantization"))
    params = SamplingParams(temperature=0, max_new_tokens=case["max_new_tokens"], ignore_eos=True)
    prompts = _prompts(oracle.loaded.config.vocab_size, seed=2)
    engine = Engine(EngineConfig(model=str(folder), tensor_parallel_size=2, **ENGINE_BASE, **case["engine"]))
    try:
        first = _run(engine, prompts, params)
        # The second wave continues the first's conversations: prefix-cache hits over shards.
        follow_ups = [prompt + answer for prompt, answer in zip(prompts, first, strict=True)]
        second = _run(engine, follow_ups, params)
    finally:
        engine.shutdown()
    _assert_oracle_tokens(first, prompts, oracle, params, "first wave")
    _assert_oracle_tokens(second, follow_ups, oracle, params, "second wave")


def router_oracle(case: dict, impl: str | None) -> int:
    """Returns how many requests went where their prefix decided (for the package tests)."""
    rng = random.Random(case["seed"])
    block_size, num_replicas = case["block_size"], case["replicas"]
    router = PrefixRouter(num_replicas, block_size)
    width = 10 * block_size
    families = [[rng.randrange(1000) for _ in range(width)] for _ in range(5)]
    history: list[tuple[list[int], str | None, int]] = []
    num_by_prefix = 0
    for step in range(case["requests"]):
        prompt = rng.choice(families)[: rng.randrange(1, width + 1)]
        prompt += [rng.randrange(1000) for _ in range(rng.randrange(0, 2 * block_size))]
        salt = rng.choice([None, None, "tenant"])
        shared = [(_common_blocks(prompt, seen, block_size), r) for seen, s, r in history if s == salt]
        longest = max((blocks for blocks, _ in shared), default=0)
        loads = list(router.loads)
        chosen = router.route(prompt, salt)
        if longest * block_size > CACHE_THRESHOLD * len(prompt):
            holders = {r for blocks, r in shared if blocks >= longest}
            assert chosen in holders, (
                f"request {step}: replica {chosen}, not one of {holders} sent its prefix"
            )
            assert loads[chosen] == min(loads[r] for r in holders), (
                f"request {step}: not the least busy holder"
            )
            num_by_prefix += 1
        else:
            assert loads[chosen] == min(loads), f"request {step}: replica {chosen} of loads {loads}"
        history.append((prompt, salt, chosen))
        # Finishes keep the loads within the balance threshold of each other.
        while sum(router.loads) > rng.randrange(1, BALANCE_ABS_THRESHOLD + 1):
            router.finished(rng.choice([r for r in range(num_replicas) if router.loads[r] > 0]))
    assert 0 < num_by_prefix < case["requests"], "the traffic must exercise both rules"
    assert router.num_prefix_routed == num_by_prefix, "the router's count of prefix-routed requests"
    assert len({r for _, _, r in history}) == num_replicas, "some replica never got a request"
    return num_by_prefix


def _common_blocks(a: list[int], b: list[int], block_size: int) -> int:
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    return min(shared // block_size, ROUTED_BLOCKS)


def data_parallel_greedy(case: dict, impl: str | None) -> None:
    folder, oracle = _checkpoint(case["preset"], None)
    params = SamplingParams(temperature=0, max_new_tokens=case["max_new_tokens"], ignore_eos=True)
    prompts = _prompts(oracle.loaded.config.vocab_size, seed=3)
    engine = Engine.spawn(
        EngineConfig(model=str(folder), data_parallel_size=2, **ENGINE_BASE, **case["engine"])
    )
    try:
        tokens = _run(engine, prompts, params)
        finished = [stats.num_finished for stats in engine.replica_stats()]
    finally:
        engine.shutdown()
    _assert_oracle_tokens(tokens, prompts, oracle, params, "data-parallel")
    assert min(finished) > 0, f"requests per replica {finished}: one replica served none"
