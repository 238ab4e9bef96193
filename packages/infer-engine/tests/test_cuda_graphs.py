"""Steps through CUDA graphs. The oracle is the same engine without graphs: graphs change how a
step (decode-only, or holding prompt chunks) is launched, never what it computes."""

import argparse
import dataclasses
import random

import numpy as np
import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine import SamplingParams, generate
from infer.engine.config import AUTO_FLAGS, EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args
from infer.engine.cuda_graphs import StepGraphs, batch_buckets, chunk_buckets, mixed_decode_buckets
from infer.engine.engine import Engine
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

from .conftest import drop_weight_files


def test_buckets_are_powers_of_two_capped_by_the_largest():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


def test_chunk_buckets_start_at_sixteen_tokens_and_end_at_the_step_budget():
    assert chunk_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert chunk_buckets(100) == [16, 32, 64, 100]
    assert chunk_buckets(8) == [8]


def test_mixed_step_decode_buckets_are_every_other_power_of_two_down_from_the_largest():
    assert mixed_decode_buckets(256) == [16, 64, 256]
    assert mixed_decode_buckets(64) == [16, 64]
    assert mixed_decode_buckets(100) == [32, 100]
    assert mixed_decode_buckets(8) == [8]


def test_mixed_step_graphs_flag_is_a_boolean():
    assert EngineConfig().cuda_graph_mixed_steps is True
    with pytest.raises(EngineConfigError, match="cuda_graph_mixed_steps must be true or false"):
        EngineConfig(cuda_graph_mixed_steps=1)


def test_cuda_graphs_on_the_cpu_are_refused_naming_the_flag():
    with pytest.raises(EngineConfigError, match="use_cuda_graphs=True needs a CUDA device"):
        EngineConfig(device="cpu", use_cuda_graphs=True)
    with pytest.raises(EngineConfigError, match="use_cuda_graphs must be true or false"):
        EngineConfig(use_cuda_graphs="yes")


def test_pdl_on_the_cpu_is_refused_naming_the_flag():
    with pytest.raises(EngineConfigError, match="use_pdl"):
        EngineConfig(device="cpu", use_pdl=True)
    with pytest.raises(EngineConfigError, match="use_pdl must be true or false"):
        EngineConfig(use_pdl="yes")


def test_triton_gemv_on_the_cpu_is_refused_naming_the_flag():
    with pytest.raises(EngineConfigError, match="use_triton_gemv=True needs a CUDA device"):
        EngineConfig(device="cpu", use_triton_gemv=True)
    with pytest.raises(EngineConfigError, match="use_triton_gemv must be true or false"):
        EngineConfig(use_triton_gemv=1)


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
    # Left out: the device's default (infer.engine.device_defaults).
    assert from_cli_args(parser.parse_args([])).use_cuda_graphs is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--use-cuda-graphs", "maybe"])


def test_step_graphs_need_a_cuda_model(tiny_models):
    model = tiny_models["llama-tiny"].loaded.model
    with pytest.raises(ValueError, match="CUDA device"):
        StepGraphs(
            model,
            [],
            max_batch_size=2,
            max_seq_len=64,
            max_num_batched_tokens=64,
            block_size=16,
            null_block=0,
        )


@pytest.fixture(scope="module")
def cuda_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-cuda")
    return {
        preset: load_model(make_random_checkpoint(preset, root / preset, dtype=torch.float32), device="cuda")
        for preset in ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]
    }


# Every switch whose default depends on the device is named (PLAIN: all off).
PLAIN = dict.fromkeys(AUTO_FLAGS, False)
GRAPH_MODES = {
    "eager": PLAIN,
    "decode-graphs": PLAIN | dict(use_cuda_graphs=True, cuda_graph_mixed_steps=False),
    "step-graphs": PLAIN | dict(use_cuda_graphs=True, cuda_graph_mixed_steps=True),
    # The graphs read decode inputs that are placeholders for the previous step's tokens.
    "step-graphs-async": PLAIN
    | dict(use_cuda_graphs=True, cuda_graph_mixed_steps=True, async_scheduling=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
@pytest.mark.parametrize("chunk_size", [None, 32], ids=["whole-prompts", "chunks-of-32"])
def test_engine_with_graphs_gives_the_tokens_of_the_engine_without(cuda_tiny, preset, chunk_size):
    loaded = cuda_tiny[preset]
    rng = random.Random(0)
    # Five requests for four rows (a later one joins), decode batches of 1 to 4 rows, and 14 blocks
    # of 16 tokens where the first four together need 20: the youngest is preempted and recomputed.
    # Prompt steps: several prompts in one step, prompts beside decodes, and with chunks of 32
    # the 150-token prompt in five steps.
    prompts = [[rng.randrange(1, loaded.config.vocab_size) for _ in range(n)] for n in (3, 150, 40, 9, 17)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    chunking = dict(use_chunked_prefill=True, prefill_chunk_size=chunk_size) if chunk_size else {}
    results = {}
    for mode, graph_settings in GRAPH_MODES.items():
        config = EngineConfig(
            device="cuda",
            max_batch_size=4,
            max_num_batched_tokens=512,
            max_seq_len=256,
            block_size=16,
            num_gpu_blocks=14,
            **graph_settings | chunking,
        )
        engine = Engine(config, loaded_model=loaded)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        tokens = {request_id: [] for request_id in ids}
        while engine.has_work():
            for output in engine.step():
                if output.token_id is not None:
                    tokens[output.request_id].append(output.token_id)
        results[mode] = [tokens[request_id] for request_id in ids]
        graphs = engine.core.runner.graphs
        if mode == "decode-graphs":
            assert graphs.num_captured == 3  # batch 1, 2 and 4
            assert graphs.num_replays["decode"] > 0 and graphs.num_replays["mixed"] == 0
        if mode == "step-graphs":
            assert graphs.num_captured == 3 + 6  # and chunk buckets 16, 32, ..., 512
            # Every step that held a prompt was a replay: the budget holds them all, and no
            # step holds more than 16 prompt rows.
            assert graphs.num_replays["mixed"] > 0
            assert sum(graphs.num_replays.values()) == engine.stats().num_steps
        if mode == "step-graphs-async":
            assert graphs.num_replays["mixed"] > 0 and graphs.num_replays["decode"] > 0
        assert engine.stats().num_preempted > 0
    assert results["decode-graphs"] == results["eager"]
    assert results["step-graphs"] == results["eager"]
    assert results["step-graphs-async"] == results["eager"]


@pytest.mark.gpu
def test_mixed_steps_of_every_decode_bucket_give_the_tokens_of_the_eager_engine(cuda_tiny):
    """40 requests arriving over time on 64 rows: prompt chunks meet 1 to 39 decode rows, so mixed
    steps replay the graphs of 16 and of 64 decode rows (their chunk rows start at row 16 or
    64), between decode-only replays; every token is the eager engine's."""
    loaded = cuda_tiny["llama-tiny"]
    rng = random.Random(2)
    prompts = [
        [rng.randrange(1, loaded.config.vocab_size) for _ in range(rng.randrange(3, 60))] for _ in range(40)
    ]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    results = {}
    for mode in ("eager", "step-graphs-async"):
        config = EngineConfig(
            device="cuda", max_batch_size=64, max_num_batched_tokens=512, max_seq_len=128, **GRAPH_MODES[mode]
        )
        engine = Engine(config, loaded_model=loaded)
        tokens = {}
        for index, prompt in enumerate(prompts):
            tokens[engine.add_request(prompt, params)] = []
            if index % 3 == 2:  # a few arrive together, then steps run
                for output in engine.step():
                    if output.token_id is not None:
                        tokens[output.request_id].append(output.token_id)
        while engine.has_work():
            for output in engine.step():
                if output.token_id is not None:
                    tokens[output.request_id].append(output.token_id)
        results[mode] = list(tokens.values())
        if mode != "eager":
            assert set(engine.core.runner.graphs.mixed_replays_by_decode_rows) == {16, 64}
    assert results["step-graphs-async"] == results["eager"]


@pytest.mark.gpu
def test_logprobs_through_graphs_and_async_steps_are_the_eager_engines(cuda_tiny):
    """Logprobs read the graphs' logits buffer after sampling, and with async scheduling before
    the next step's replay overwrites it: the values must be the eager engine's. Two of four
    requests ask, so the rows that ask are a subset of each step's sampling rows."""
    loaded = cuda_tiny["llama-tiny"]
    rng = random.Random(1)
    prompts = [[rng.randrange(1, loaded.config.vocab_size) for _ in range(n)] for n in (3, 60, 17, 9)]
    asking = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, logprobs=4)
    silent = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    results = {}
    for mode, graph_settings in GRAPH_MODES.items():
        config = EngineConfig(
            device="cuda", max_batch_size=4, max_num_batched_tokens=512, max_seq_len=128, **graph_settings
        )
        engine = Engine(config, loaded_model=loaded)
        ids = [engine.add_request(p, asking if i % 2 == 0 else silent) for i, p in enumerate(prompts)]
        outputs = {request_id: [] for request_id in ids}
        while engine.has_work():
            for output in engine.step():
                if output.token_id is not None:
                    outputs[output.request_id].append(output)
        results[mode] = [outputs[request_id] for request_id in ids]
        if engine.core.runner.graphs is not None:
            assert sum(engine.core.runner.graphs.num_replays.values()) > 0
    eager = results.pop("eager")
    for mode, outputs in results.items():
        for index, (expected, got) in enumerate(zip(eager, outputs, strict=True)):
            assert [o.token_id for o in got] == [o.token_id for o in expected], (mode, index)
            if index % 2:
                assert all(o.logprobs is None for o in got), (mode, index)
                continue
            for want, have in zip(expected, got, strict=True):
                assert have.logprobs.top_token_ids == want.logprobs.top_token_ids, (mode, index)
                assert have.logprobs.logprob == pytest.approx(want.logprobs.logprob, abs=1e-4), (mode, index)
                assert have.logprobs.top_logprobs == pytest.approx(want.logprobs.top_logprobs, abs=1e-4)


@pytest.mark.gpu
def test_graph_logits_equal_the_eager_forward_at_real_shape_in_bf16(tmp_path):
    """One decode step of a 1B model over a 300-token cache: the replayed graph and an eager
    forward of the very batch it replays (its static buffers, the same launch sizes) agree and
    pick the same token. (An eager step sizes the attention's splits by its own longest row, so it
    sums in another order; the engine tests compare tokens across that.)"""
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path / "llama", dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    drop_weight_files(folder)
    engine = Engine(
        EngineConfig(
            **PLAIN
            | dict(device="cuda", dtype="bfloat16", max_batch_size=2, max_seq_len=512, use_cuda_graphs=True)
        ),
        loaded_model=loaded,
    )
    prompt = torch.randint(0, 32000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    engine.add_request(prompt, params, request_id="r")
    engine.step()  # the prompt: eager; its first token is sampled
    runner = engine.core.runner
    decision = engine.core.scheduler.schedule()
    runner.input_batch.apply(decision)
    step = runner.input_batch.prepare(decision)
    graph_logits = runner.graphs.logits(step)[0].float().clone()
    with torch.inference_mode():
        eager_logits = loaded.model.compute_logits(loaded.model(runner.graphs._decode_batch(1)))[0].float()
    assert torch.allclose(graph_logits, eager_logits, atol=0.1, rtol=0.02), (
        (graph_logits - eager_logits).abs().max().item()
    )
    assert graph_logits.argmax() == eager_logits.argmax()


@pytest.mark.gpu
def test_one_request_with_pdl_gives_the_tokens_and_logprobs_of_plain_launches(tmp_path):
    """PDL changes when a batch-1 decode step's kernels launch, not what they compute: the same
    kernels on the same inputs give the same logprobs to the last bit, through graphs and async
    steps (and eagerly, without graphs). Real 1B shapes, so that every kernel runs long enough for
    a read before its input is complete to show."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    folder = make_random_checkpoint("qwen3-1.7b", tmp_path / "qwen3", dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    drop_weight_files(folder)
    prompt = torch.randint(0, 32000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logprobs=3)
    eager = dict(use_cuda_graphs=False, async_scheduling=False)
    for graph_settings in (dict(use_cuda_graphs=True, async_scheduling=True), eager):
        results = []
        for use_pdl in (False, True):
            config = EngineConfig(
                device="cuda", max_batch_size=1, max_seq_len=512, use_pdl=use_pdl, **graph_settings
            )
            engine = Engine(config, loaded_model=loaded)
            engine.add_request(prompt, params)
            outputs = []
            while engine.has_work():
                outputs += [o for o in engine.step() if o.token_id is not None]
            assert len(outputs) == params.max_new_tokens
            results.append([(o.token_id, o.logprobs.logprob, o.logprobs.top_logprobs) for o in outputs])
        assert results[1] == results[0], graph_settings


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


@pytest.mark.gpu
def test_mixed_step_graph_logits_equal_the_eager_forward_at_real_shape_in_bf16(tmp_path):
    """A step of two decode rows (300 and 40 cached tokens) and the last 36-token chunk of a
    100-token prompt, at Llama 3.2 1B shapes: the replayed graph (pad
    rows, the chunks moved behind max_batch_size decode rows, a tile map) and the eager forward of
    the same step give the same logits within bf16's tolerance and pick the same tokens. The eager
    forward is launched as the graph is (decode splits sized for max_seq_len), so that the two
    sum attention in the same order; the engine tests compare tokens across launch sizes.

    The step follows prompt chunks that sample nothing: the graphs' pinned inputs must not be
    overwritten before the previous step's copies ran (this once gave request a wrong first
    token), so a's tokens are checked against the recompute oracle too."""
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path / "llama", dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    drop_weight_files(folder)
    engine = Engine(
        EngineConfig(
            device="cuda",
            dtype="bfloat16",
            max_batch_size=4,
            max_seq_len=512,
            **PLAIN | dict(use_cuda_graphs=True, use_chunked_prefill=True),
            prefill_chunk_size=64,
            max_num_batched_tokens=256,
        ),
        loaded_model=loaded,
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    prompt_a = torch.randint(0, 32000, (300,), generator=gen).tolist()
    engine.add_request(prompt_a, params, request_id="a")
    first_tokens = []
    while not first_tokens:
        # a's prompt, in chunks of 64
        first_tokens = [output.token_id for output in engine.step() if output.token_id is not None]
    assert first_tokens == RecomputeOracle(loaded).generate(prompt_a, params).token_ids[:1]
    for request_id, length in (("b", 40), ("c", 100)):
        prompt = torch.randint(0, 32000, (length,), generator=gen).tolist()
        engine.add_request(prompt, params, request_id=request_id)
    engine.step()  # a decodes, b runs whole, c its first 64 tokens
    # The step under test: a and b decode, c's last 36 tokens; all three sample.
    runner = engine.core.runner
    decision = engine.core.scheduler.schedule()
    runner.input_batch.apply(decision)
    step = runner.input_batch.prepare(decision)
    assert (step.num_decode_rows, len(step.request_ids), len(step.sampling_rows)) == (2, 3, 3)
    graph_logits = runner.graphs.logits(step).float().clone()
    assert runner.graphs.num_replays["mixed"] >= 1
    with torch.inference_mode():
        # The graph's launch: block tables as wide as max_seq_len (null blocks past each row's).
        tables = np.full((len(step.request_ids), runner.graphs.max_blocks), runner.null_block, np.int32)
        tables[:, : step.block_tables.shape[1]] = step.block_tables
        wide_step = dataclasses.replace(step, block_tables=tables)
        batch = runner.forward_batch(wide_step, logits_indices=step.logits_indices)
        batch = dataclasses.replace(
            batch, attention=dataclasses.replace(batch.attention, max_seq_len=runner.graphs.max_seq_len)
        )
        eager_logits = loaded.model.compute_logits(loaded.model(batch)).float()
    assert graph_logits.shape == eager_logits.shape == (len(step.sampling_rows), loaded.config.vocab_size)
    assert torch.allclose(graph_logits, eager_logits, atol=0.1, rtol=0.02), (
        (graph_logits - eager_logits).abs().max().item()
    )
    assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))
