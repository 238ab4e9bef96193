"""Embedding requests (SamplingParams.pooling): the pooled final hidden states of their prompts,
against transformers' `last_hidden_state` (after the final norm) of each prompt run alone."""

import numpy as np
import pytest
import torch

from infer.engine import Engine, EngineConfig, SamplingParams

from .conftest import TINY_PRESETS, cuda_engine, run_together

# Prompts of several lengths: with chunks of 16 tokens, one, two and three chunks.
PROMPT_LENGTHS = (5, 23, 40)


def pooling_params(kind: str) -> SamplingParams:
    return SamplingParams(max_new_tokens=1, temperature=0.0, pooling=kind)


def reference_hidden(model, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden states of `prompt` alone: [len(prompt), hidden]."""
    with torch.inference_mode():
        return model.reference.model(torch.tensor([prompt])).last_hidden_state[0].float()


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_pooled_hidden_states_equal_transformers_for_last_and_mean_pooling(tiny_models, preset):
    model = tiny_models[preset]
    config = EngineConfig(
        max_batch_size=4,
        max_seq_len=128,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        use_prefix_caching=True,
    )
    engine = Engine(config, loaded_model=model.loaded)
    vocab = model.loaded.config.vocab_size
    generator = np.random.default_rng(7)
    prompts = [generator.integers(3, vocab, size=length).tolist() for length in PROMPT_LENGTHS]
    # Mixed with a plain generation request: pooling rows share steps with sampling rows.
    generation = (prompts[1][:10], SamplingParams(max_new_tokens=8, temperature=0.0))
    requests = [(prompt, pooling_params(kind)) for kind in ("last", "mean") for prompt in prompts]
    results = run_together(engine, [generation, *requests])
    assert results[0]["embedding"] is None and len(results[0]["tokens"]) == 8
    for (prompt, params), result in zip(requests, results[1:], strict=True):
        hidden = reference_hidden(model, prompt)
        expected = hidden[-1] if params.pooling == "last" else hidden.mean(dim=0)
        embedding = torch.from_numpy(result["embedding"])
        assert embedding.dtype == torch.float32 and embedding.shape == expected.shape
        torch.testing.assert_close(embedding, expected, rtol=1e-4, atol=1e-4)
        assert len(result["tokens"]) == 1  # the one token that ends the request, never shown


def test_a_cached_prompt_pools_the_same_vector_and_mean_pooling_recomputes(tiny_models):
    """Last-token pooling reads only the last token's hidden state, so it may reuse the prefix
    cache's K/V; mean pooling needs every token's and runs without the cache."""
    model = tiny_models["llama-tiny"]
    config = EngineConfig(
        max_batch_size=2,
        max_seq_len=128,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        use_prefix_caching=True,
    )
    engine = Engine(config, loaded_model=model.loaded)
    prompt = np.random.default_rng(3).integers(3, model.loaded.config.vocab_size, size=48).tolist()
    hidden = reference_hidden(model, prompt)
    for kind, expected in (("last", hidden[-1]), ("mean", hidden.mean(dim=0))):
        first, again = (run_together(engine, [(prompt, pooling_params(kind))])[0] for _ in range(2))
        for result in (first, again):
            torch.testing.assert_close(torch.from_numpy(result["embedding"]), expected, rtol=1e-4, atol=1e-4)
        if kind == "last":
            assert again["cached"] >= 32  # served from the cache (its first run, or the mean's, put it there)
        else:
            assert again["cached"] == 0


def test_pooling_settings_are_checked():
    with pytest.raises(ValueError, match="pooling must be"):
        SamplingParams(max_new_tokens=1, pooling="cls")
    with pytest.raises(ValueError, match="max_new_tokens 1"):
        SamplingParams(max_new_tokens=2, pooling="last")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pooling_on_cuda_with_graphs_and_async_scheduling(tiny_models, tiny_checkpoints):
    """A step that pools runs eagerly beside graph-replayed steps; its vectors reach the host with
    the step's tokens (async scheduling collects a step late)."""
    model = tiny_models["llama-tiny"]
    engine = cuda_engine(tiny_checkpoints["llama-tiny"])
    prompts = [
        np.random.default_rng(length).integers(3, 200, size=length).tolist() for length in PROMPT_LENGTHS
    ]
    generation = (prompts[2][:12], SamplingParams(max_new_tokens=16, temperature=0.0))
    requests = [(prompt, pooling_params(kind)) for kind in ("last", "mean") for prompt in prompts]
    results = run_together(engine, [generation, *requests])
    for (prompt, params), result in zip(requests, results[1:], strict=True):
        hidden = reference_hidden(model, prompt)
        expected = hidden[-1] if params.pooling == "last" else hidden.mean(dim=0)
        # TF32 matmuls on the GPU against the CPU's float32.
        torch.testing.assert_close(torch.from_numpy(result["embedding"]), expected, rtol=2e-2, atol=2e-2)
