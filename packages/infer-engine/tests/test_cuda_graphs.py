"""Decode through CUDA graphs. The oracle is the same engine without graphs: graphs change how a
decode-only step is launched, never what it computes."""

import argparse
import random

import pytest
import torch

from infer.engine import SamplingParams, generate
from infer.engine.config import EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args
from infer.engine.cuda_graphs import DecodeGraphs, batch_buckets
from infer.engine.engine import Engine
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint


def test_buckets_are_powers_of_two_capped_by_the_largest():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


def test_cuda_graphs_on_the_cpu_are_refused_naming_the_flag():
    with pytest.raises(EngineConfigError, match="use_cuda_graphs=True needs a CUDA device"):
        EngineConfig(device="cpu", use_cuda_graphs=True)
    with pytest.raises(EngineConfigError, match="use_cuda_graphs must be true or false"):
        EngineConfig(use_cuda_graphs="yes")


def test_cuda_graphs_need_the_paged_pool_and_continuous_batching():
    with pytest.raises(
        EngineConfigError, match="requires batching_mode='continuous' and kv_cache_backend='paged'"
    ):
        EngineConfig(use_cuda_graphs=True, kv_cache_backend="contiguous")
    with pytest.raises(EngineConfigError, match="requires batching_mode='continuous'"):
        EngineConfig(use_cuda_graphs=True, batching_mode="static")


def test_cuda_graphs_flag_parses_true_and_false():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert from_cli_args(parser.parse_args(["--use-cuda-graphs", "true"])).use_cuda_graphs is True
    assert from_cli_args(parser.parse_args(["--use-cuda-graphs", "false"])).use_cuda_graphs is False
    # Alone, as `infer generate --use-cuda-graphs` spells it.
    assert from_cli_args(parser.parse_args(["--use-cuda-graphs"])).use_cuda_graphs is True
    assert from_cli_args(
        parser.parse_args(["--use-chunked-prefill", "--max-batch-size", "4"])
    ).use_chunked_prefill
    assert from_cli_args(parser.parse_args([])).use_cuda_graphs is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--use-cuda-graphs", "maybe"])


def test_decode_graphs_need_a_cuda_model(tiny_models):
    model = tiny_models["llama-tiny"].loaded.model
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, [], max_batch_size=2, max_seq_len=64, block_size=16, null_block=0)


@pytest.fixture(scope="module")
def cuda_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-cuda")
    return {
        preset: load_model(make_random_checkpoint(preset, root / preset, dtype=torch.float32), device="cuda")
        for preset in ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]
    }


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_engine_with_graphs_gives_the_tokens_of_the_engine_without(cuda_tiny, preset):
    loaded = cuda_tiny[preset]
    rng = random.Random(0)
    # Five requests for four rows (a later one joins), decode batches of 1 to 4 rows, and 14 blocks
    # of 16 tokens where the first four together need 20: the youngest is preempted and recomputed.
    prompts = [[rng.randrange(1, loaded.config.vocab_size) for _ in range(n)] for n in (3, 150, 40, 9, 17)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    results = {}
    for use_cuda_graphs in (False, True):
        config = EngineConfig(
            device="cuda",
            max_batch_size=4,
            max_num_batched_tokens=512,
            max_seq_len=256,
            block_size=16,
            num_gpu_blocks=14,
            use_cuda_graphs=use_cuda_graphs,
        )
        engine = Engine(config, loaded_model=loaded)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        tokens = {request_id: [] for request_id in ids}
        while engine.has_work():
            for output in engine.step():
                if output.token_id is not None:
                    tokens[output.request_id].append(output.token_id)
        results[use_cuda_graphs] = [tokens[request_id] for request_id in ids]
        if use_cuda_graphs:
            assert engine.runner.decode_graphs.num_captured == 3  # batch 1, 2 and 4
        assert engine.stats().num_preempted > 0
    assert results[True] == results[False]


@pytest.mark.gpu
def test_graph_logits_equal_the_eager_forward_at_real_shape_in_bf16(tmp_path):
    """One decode step of a 1B model over a 300-token cache: the replayed graph and an eager
    forward of the very batch it replays (its static buffers, the same launch sizes) agree and
    pick the same token. (An eager step sizes the attention's splits by its own longest row, so it
    sums in another order; the engine tests compare tokens across that.)"""
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path / "llama", dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    engine = Engine(
        EngineConfig(
            device="cuda", dtype="bfloat16", max_batch_size=2, max_seq_len=512, use_cuda_graphs=True
        ),
        loaded_model=loaded,
    )
    prompt = torch.randint(0, 32000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    engine.add_request(prompt, params, request_id="r")
    engine.step()  # the prompt: eager; its first token is sampled
    runner = engine.runner
    decision = engine.scheduler.schedule()
    runner.input_batch.apply(decision)
    step = runner.input_batch.prepare(decision)
    graph_logits = (
        runner.decode_graphs.logits(
            step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.block_tables
        )[0]
        .float()
        .clone()
    )
    with torch.inference_mode():
        eager_logits = loaded.model.compute_logits(loaded.model(runner.decode_graphs._batch(1)))[0].float()
    assert torch.allclose(graph_logits, eager_logits, atol=0.1, rtol=0.02), (
        (graph_logits - eager_logits).abs().max().item()
    )
    assert graph_logits.argmax() == eager_logits.argmax()


@pytest.mark.gpu
def test_one_request_with_graphs_gives_the_tokens_without(cuda_tiny):
    loaded = cuda_tiny["qwen3-tiny"]
    prompt = list(range(5, 70))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    results = []
    for use_cuda_graphs in (False, True):
        config = EngineConfig(
            device="cuda", max_batch_size=1, max_seq_len=128, use_cuda_graphs=use_cuda_graphs
        )
        results.append(generate(Engine(config, loaded_model=loaded), prompt, params).token_ids)
    assert results[0] == results[1]
