"""The engine with tensor_parallel_size 2 on the CPU (infer.engine.tensor_parallel): rank 0 in
this process, rank 1 a worker process, over gloo. The oracles: the same engine with one rank,
and the recompute oracle (no cache, no batching): the same greedy tokens for every
architecture, through chunked prefill and the prefix cache. A worker that dies ends the engine
with an error that names it."""

import os
import signal

import pytest

from conformance.engine_runs import run_to_completion, token_ids
from infer.engine.client import EngineDeadError
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams

from .test_engine import random_prompts

NUM_TOKENS = 16


def make_engine(folder, tensor_parallel_size: int) -> Engine:
    return Engine(
        EngineConfig(
            model=str(folder),
            max_batch_size=4,
            max_seq_len=160,
            block_size=4,
            use_chunked_prefill=True,
            prefill_chunk_size=16,
            use_prefix_caching=True,
            tensor_parallel_size=tensor_parallel_size,
        )
    )


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
