"""The engine with tensor_parallel_size 2 on the CPU (infer.engine.tensor_parallel): rank 0 in
this process, rank 1 a worker process, over gloo. The oracles: the same engine with one rank,
and the recompute oracle (no cache, no batching): the same greedy tokens for every
architecture, through chunked prefill and the prefix cache. A worker that dies ends the engine
with an error that names it."""

import os
import signal
import subprocess
import sys

import pytest

from conformance.engine_runs import run_to_completion, token_ids
from infer.engine.client import EngineDeadError
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams
from infer.models.tensor_parallel import free_local_port

from .test_engine import random_prompts

NUM_TOKENS = 16


SETTINGS = dict(
    max_batch_size=4,
    max_seq_len=160,
    block_size=4,
    use_chunked_prefill=True,
    prefill_chunk_size=16,
    use_prefix_caching=True,
)


def make_engine(folder, tensor_parallel_size: int, **settings) -> Engine:
    config = {**SETTINGS, **settings}
    return Engine(EngineConfig(model=str(folder), tensor_parallel_size=tensor_parallel_size, **config))


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "smollm2-135m-instruct"])
def test_two_ranks_give_the_greedy_tokens_of_one(tiny_models, tiny_checkpoints, preset):
    if preset == "smollm2-135m-instruct":
        folder, oracle, vocab_size = "smollm2-135m-instruct", None, 49152
    else:
        folder, oracle, vocab_size = tiny_checkpoints[preset], tiny_models[preset].oracle, 384
    prompts = random_prompts([30, 7, 45], vocab_size, seed=2)
    prompts.append(prompts[0][:20] + prompts[1])  # shares a prefix with the first: a cache hit
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    tokens = {}
    for size in (1, 2):
        engine = make_engine(folder, size)
        try:
            ids = [engine.add_request(prompt, params) for prompt in prompts]
            outputs = run_to_completion(engine)
            tokens[size] = [token_ids(outputs[request_id]) for request_id in ids]
        finally:
            engine.shutdown()
    assert tokens[2] == tokens[1]
    if oracle is not None:
        assert tokens[2] == [oracle.generate(prompt, params).token_ids for prompt in prompts]


def test_a_worker_that_dies_ends_the_engine_with_an_error_naming_it(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama-tiny"], 2)
    try:
        engine.add_request(random_prompts([30], 384, seed=1)[0], SamplingParams(max_new_tokens=100))
        engine.step()
        (worker,) = engine.core.runner.link.processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker rank 1 exited \(exit code -9\)"):
            while engine.has_work():
                engine.step()
    finally:
        engine.shutdown()


def test_tensor_parallelism_refuses_what_it_cannot_shard_by_name(tiny_models):
    with pytest.raises(EngineConfigError, match="speculative_config with tensor_parallel_size > 1"):
        ngram = {"method": "ngram", "num_speculative_tokens": 2}
        EngineConfig(tensor_parallel_size=2, speculative_config=ngram)
    with pytest.raises(EngineConfigError, match="tensor_parallel_size > 1 loads each rank's shard"):
        Engine(EngineConfig(tensor_parallel_size=2), loaded_model=tiny_models["llama-tiny"].loaded)


def test_two_nodes_on_one_host_meet_at_master_port_and_give_the_greedy_tokens_of_one_rank(
    tiny_models, tiny_checkpoints
):
    """The multi-host rendezvous on one machine: node 1 is `python -m infer.engine.node` with
    node 0's flags and --node-rank 1 (what a second host would run); node 0 is the engine here."""
    folder, tiny = tiny_checkpoints["qwen3-tiny"], tiny_models["qwen3-tiny"]
    port = free_local_port()
    nodes = dict(nnodes=2, master_addr="127.0.0.1", master_port=port)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in {**SETTINGS, **nodes}.items()]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infer.engine.node",
            f"--model={folder}",
            "--tensor-parallel-size=2",
            "--node-rank=1",
            *flags,
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        engine = make_engine(folder, 2, node_rank=0, **nodes)
        params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
        prompts = random_prompts([30, 9], 384, seed=3)
        try:
            ids = [engine.add_request(prompt, params) for prompt in prompts]
            outputs = run_to_completion(engine)
        finally:
            engine.shutdown()
        assert [token_ids(outputs[i]) for i in ids] == [
            tiny.oracle.generate(p, params).token_ids for p in prompts
        ]
        assert node1.wait(timeout=60) == 0  # node 0's shutdown stopped it
    finally:
        node1.kill()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(tensor_parallel_size=3, nnodes=2, master_port=1234),
            r"tensor_parallel_size \(3\) must be a multiple of nnodes \(2\)",
        ),
        (
            dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234),
            r"node_rank \(2\) must be below nnodes \(2\)",
        ),
        (dict(tensor_parallel_size=2, nnodes=2), "nnodes > 1 needs master_port"),
    ],
)
def test_node_settings_are_checked_naming_the_field(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**settings)
