"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob, rank and the
top k at the position before it, against transformers' logits for each prompt run alone."""

import numpy as np
import pytest
import torch

from infer.engine import Engine, EngineConfig, SamplingParams, prompt_logprobs

from .conftest import TINY_PRESETS, cuda_engine, run_together

# With chunks of 16 tokens: a prompt of one token (nothing to score), one chunk, two, and three.
PROMPT_LENGTHS = (1, 5, 23, 40)


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax of `prompt`'s logits at every position: [len(prompt), vocab]."""
    with torch.inference_mode():
        return model.reference(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def assert_matches_reference(model, prompt: list[int], result, k: int) -> None:
    expected = reference_logprobs(model, prompt)[:-1]  # position p - 1 predicts token p
    targets = torch.tensor(prompt[1:])
    target_logprobs = expected.gather(1, targets[:, None]).squeeze(1)
    assert len(result) == len(prompt) - 1
    torch.testing.assert_close(torch.from_numpy(result.token_logprobs), target_logprobs, rtol=1e-4, atol=1e-4)
    ranks = (expected > target_logprobs[:, None]).sum(dim=-1) + 1
    assert result.ranks.tolist() == ranks.tolist()
    top = expected.topk(k, dim=-1)
    assert result.top_token_ids.shape == result.top_logprobs.shape == (len(prompt) - 1, k)
    assert result.top_token_ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(torch.from_numpy(result.top_logprobs), top.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_prompt_logprobs_equal_transformers_chunk_by_chunk_beside_other_requests(tiny_models, preset):
    model = tiny_models[preset]
    config = EngineConfig(
        max_batch_size=8,
        max_seq_len=128,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        use_prefix_caching=True,
    )
    engine = Engine(config, loaded_model=model.loaded)
    generator = np.random.default_rng(11)
    vocab = model.loaded.config.vocab_size
    prompts = [generator.integers(3, vocab, size=length).tolist() for length in PROMPT_LENGTHS]
    # Each prompt asks for a different number of alternatives (a step computes its largest ask),
    # beside a plain generation request and one with sampled-token logprobs.
    asks = (0, 3, 1, 5)
    requests = [
        (prompt, SamplingParams(max_new_tokens=4, temperature=0.0, prompt_logprobs=k))
        for prompt, k in zip(prompts, asks, strict=True)
    ]
    others = [
        (prompts[3][:20], SamplingParams(max_new_tokens=6, temperature=0.0)),
        (prompts[2], SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=2)),
    ]
    results = run_together(engine, [*others, *requests])
    assert all(result["prompt_logprobs"] is None for result in results[:2])
    for (prompt, params), result in zip(requests, results[2:], strict=True):
        assert_matches_reference(model, prompt, result["prompt_logprobs"], params.prompt_logprobs)
        assert len(result["tokens"]) == 4
    # Scoring the prompt leaves the greedy output as it is.
    assert results[1]["tokens"] == results[4]["tokens"]


def test_a_cached_prompt_is_recomputed_for_its_prompt_logprobs(tiny_models, monkeypatch):
    """A cached token has its K/V but no logits: a request asking for prompt logprobs runs its
    whole prompt, even when the prefix cache holds it."""
    # Chunks of 16 tokens scored 5 rows at a time: the bound on the rows whose logits are held.
    monkeypatch.setattr(prompt_logprobs, "MAX_SCORED_ROWS", 5)
    model = tiny_models["llama-tiny"]
    config = EngineConfig(
        max_batch_size=2,
        max_seq_len=128,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        use_prefix_caching=True,
    )
    engine = Engine(config, loaded_model=model.loaded)
    prompt = np.random.default_rng(5).integers(3, model.loaded.config.vocab_size, size=48).tolist()
    plain = run_together(engine, [(prompt, SamplingParams(max_new_tokens=2, temperature=0.0))])[0]
    again = run_together(engine, [(prompt, SamplingParams(max_new_tokens=2, temperature=0.0))])[0]
    assert again["cached"] >= 32  # the prompt is in the cache
    scored = run_together(
        engine, [(prompt, SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=2))]
    )[0]
    assert scored["cached"] == 0
    assert_matches_reference(model, prompt, scored["prompt_logprobs"], 2)
    assert scored["tokens"] == plain["tokens"]


# (prompt lengths, tokens each): short answers preempt the youngest mid-prompt; longer ones
# preempt requests that have answered, which resume with their tokens.
PREEMPTIONS = {"mid-prompt": ((3, 30, 9, 100, 17), 6), "after-first-token": ((3, 30, 9, 80, 17), 24)}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("when", PREEMPTIONS)
def test_preempted_requests_give_their_prompt_logprobs_once(tiny_models, when, async_scheduling):
    """A pool too small for the running requests preempts the youngest (recomputed later): one
    preempted mid-prompt scores its prompt over, one preempted after its first token does not
    score it again, and each request's prompt logprobs come once, whole."""
    model = tiny_models["llama-tiny"]
    config = EngineConfig(
        max_batch_size=3,
        max_num_batched_tokens=16,
        max_seq_len=128,
        block_size=4,
        num_gpu_blocks=30,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        async_scheduling=async_scheduling,
    )
    engine = Engine(config, loaded_model=model.loaded)
    lengths, num_tokens = PREEMPTIONS[when]
    generator = np.random.default_rng(2)
    prompts = [generator.integers(3, model.loaded.config.vocab_size, size=n).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=num_tokens, temperature=0.0, prompt_logprobs=2)
    results = run_together(engine, [(prompt, params) for prompt in prompts])
    assert engine.stats().num_preempted > 0, "the small pool should have forced a preemption"
    for prompt, result in zip(prompts, results, strict=True):
        assert_matches_reference(model, prompt, result["prompt_logprobs"], 2)
        assert result["tokens"] == model.oracle.generate(prompt, params).token_ids


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prompt_logprobs_on_cuda_with_graphs_and_async_scheduling(tiny_models, tiny_checkpoints):
    """A step that scores prompt chunks runs eagerly beside graph-replayed steps; the chunks'
    results reach the host with the step that ends the prompt (async scheduling collects a step
    late)."""
    model = tiny_models["llama-tiny"]
    engine = cuda_engine(tiny_checkpoints["llama-tiny"])
    prompts = [
        np.random.default_rng(length).integers(3, 200, size=length).tolist() for length in PROMPT_LENGTHS
    ]
    generation = (prompts[3][:12], SamplingParams(max_new_tokens=16, temperature=0.0))
    requests = [
        (prompt, SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=4)) for prompt in prompts
    ]
    results = run_together(engine, [generation, *requests])
    for (prompt, _), result in zip(requests, results[1:], strict=True):
        scored = result["prompt_logprobs"]
        expected = reference_logprobs(model, prompt)[:-1]
        targets = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        # TF32 matmuls on the GPU against the CPU's float32.
        torch.testing.assert_close(torch.from_numpy(scored.token_logprobs), targets, rtol=2e-2, atol=2e-2)
        assert scored.top_token_ids.shape == (len(prompt) - 1, 4)
