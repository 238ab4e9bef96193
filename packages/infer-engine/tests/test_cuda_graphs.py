"""Decode through CUDA graphs. The oracle is the same engine, or the same generator, without graphs:
graphs change how the decode forward is launched, never what it computes."""

import random

import pytest
import torch

from infer.engine import SamplingParams, SingleRequestGenerator
from infer.engine.config import EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args
from infer.engine.cuda_graphs import DecodeGraphs, _buckets
from infer.engine.engine import Engine
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint


def test_buckets_are_powers_of_two_capped_by_the_largest():
    assert _buckets(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert _buckets(1, 6) == [1, 2, 4, 6]


def test_cuda_graphs_on_the_cpu_are_refused_naming_the_flag():
    with pytest.raises(EngineConfigError, match="cuda_graphs=True needs a CUDA device"):
        EngineConfig(device="cpu", cuda_graphs=True)
    with pytest.raises(EngineConfigError, match="cuda_graphs must be true or false"):
        EngineConfig(cuda_graphs="yes")


def test_cuda_graphs_flag_parses_true_and_false():
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert from_cli_args(parser.parse_args(["--cuda-graphs", "true"])).cuda_graphs is True
    assert from_cli_args(parser.parse_args(["--cuda-graphs", "false"])).cuda_graphs is False
    assert from_cli_args(parser.parse_args([])).cuda_graphs is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graphs", "maybe"])


def test_decode_graphs_need_a_cuda_model(tiny_models):
    model = tiny_models["llama-tiny"].loaded.model
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, [], max_seq_len=64, max_batch_size=2)


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
    # Five requests for four slots (a later one joins), batches of 1 to 4 rows.
    prompts = [[rng.randrange(1, loaded.config.vocab_size) for _ in range(n)] for n in (3, 150, 40, 9, 17)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    results = {}
    for cuda_graphs in (False, True):
        config = EngineConfig(
            device="cuda",
            max_batch_size=4,
            max_num_batched_tokens=512,
            max_seq_len=256,
            cuda_graphs=cuda_graphs,
        )
        engine = Engine(config, loaded_model=loaded)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        tokens = {request_id: [] for request_id in ids}
        while engine.has_work():
            for output in engine.step():
                if output.token_id is not None:
                    tokens[output.request_id].append(output.token_id)
        results[cuda_graphs] = [tokens[request_id] for request_id in ids]
        if cuda_graphs:
            assert engine.runner.decode_graphs.num_captured == 3  # batch 1, 2 and 4
    assert results[True] == results[False]


@pytest.mark.gpu
def test_graph_logits_equal_the_eager_forward_at_real_shape_in_bf16(tmp_path):
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path / "llama", dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    generator = SingleRequestGenerator.from_loaded(loaded, cuda_graph=True)
    forward = generator.forward
    prompt = torch.randint(0, 32000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    forward.reserve(len(prompt) + 8)
    forward.prefill(prompt)
    token_id = 1234
    graph_logits = forward.decode(token_id).float().clone()
    # The same step eagerly: the token at position len(prompt), reading the same cache.
    batch = ForwardBatch(
        input_ids=torch.tensor([[token_id]], device="cuda"),
        positions=torch.tensor([[len(prompt)]], device="cuda"),
        kv_layers=forward.cache.kv_layers,
        context_len=len(prompt) + 1,
    )
    with torch.inference_mode():
        eager_logits = loaded.model.compute_logits(loaded.model(batch)[:, 0])[0].float()
    assert torch.allclose(graph_logits, eager_logits, atol=0.1, rtol=0.02), (
        (graph_logits - eager_logits).abs().max().item()
    )
    assert graph_logits.argmax() == eager_logits.argmax()


@pytest.mark.gpu
def test_generator_with_a_graph_gives_the_tokens_without_one(cuda_tiny):
    loaded = cuda_tiny["qwen3-tiny"]
    prompt = list(range(5, 70))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    eager = SingleRequestGenerator.from_loaded(loaded).generate(prompt, params)
    graphed = SingleRequestGenerator.from_loaded(loaded, cuda_graph=True).generate(prompt, params)
    assert graphed.token_ids == eager.token_ids
