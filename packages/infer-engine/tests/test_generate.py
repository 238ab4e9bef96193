"""Generation: the KV-cache path against recompute, and greedy output against transformers.

Oracles: `RecomputeForward` (no cache: the whole sequence every step) for the cache, and
transformers' eager `generate` for the model, sampler and stop loop together.
"""

import pytest
import torch

from infer.engine import CachedForward, RecomputeForward, SamplingParams

from .conftest import TINY_PRESETS

GREEDY = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
TINY_GREEDY = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_kv_cache_greedy_equals_recompute_greedy(tiny_models, preset):
    model = tiny_models[preset]
    prompt_ids = [5, 91, 200, 17, 300, 42, 7]
    cached = model.cached.generate(prompt_ids, TINY_GREEDY)
    assert len(cached.token_ids) == 32 and cached.finish_reason == "length"
    assert cached.token_ids == model.recompute.generate(prompt_ids, TINY_GREEDY).token_ids


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_kv_cache_logits_equal_recompute_logits_along_a_forced_sequence(tiny_models, preset):
    # Greedy tokens of a random model can repeat one id; forcing a random sequence makes every
    # step see new keys at new positions (past Gemma's 4-token sliding window).
    model = tiny_models[preset].loaded.model
    tokens = torch.randint(
        0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    cached, recompute = CachedForward(model), RecomputeForward(model)
    cached.reserve(len(tokens))
    pairs = [(cached.prefill(tokens[:8]), recompute.prefill(tokens[:8]))]
    pairs += [(cached.decode(token), recompute.decode(token)) for token in tokens[8:]]
    for step, (ours, oracle) in enumerate(pairs):
        torch.testing.assert_close(ours, oracle, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_cache_is_reused_across_requests_of_different_lengths(tiny_models):
    model = tiny_models["llama-tiny"]
    long_prompt, short_prompt = list(range(10, 60)), [3, 4, 5]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    model.cached.generate(long_prompt, params)
    # The short request runs on a cache holding the long one's stale keys.
    assert model.cached.generate(short_prompt, params) == model.recompute.generate(short_prompt, params)


def test_seeded_sampling_repeats_and_seeds_differ(tiny_models):
    # llama-tiny's logits are the least peaked of the tiny presets, so draws vary with the seed.
    generator = tiny_models["llama-tiny"].cached
    prompt_ids = [1, 2, 3]

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=16, seed=seed, ignore_eos=True)
        return generator.generate(prompt_ids, params).token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_every_chunk_but_the_last_is_unfinished(tiny_models):
    chunks = list(
        tiny_models["gemma3-tiny"].cached.stream([2, 50, 60], SamplingParams(max_new_tokens=5, seed=0))
    )
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason in ("stop", "length")


def test_prompt_too_long_for_the_model_is_rejected(tiny_models):
    model = tiny_models["llama-tiny"]
    with pytest.raises(ValueError, match="shorten the prompt"):
        model.cached.generate([1] * model.loaded.config.max_position_embeddings, GREEDY)


def test_max_new_tokens_is_capped_by_the_context(tiny_models):
    model = tiny_models["llama-tiny"]
    prompt_ids = [1] * (model.loaded.config.max_position_embeddings - 3)
    result = model.cached.generate(prompt_ids, GREEDY)
    assert (len(result.token_ids), result.finish_reason) == (3, "length")


@pytest.mark.slow
def test_kv_cache_greedy_equals_recompute_on_smollm2(smollm2):
    prompt_ids = smollm2.chat_ids("Write a short story about a robot who learns to paint.")
    cached = smollm2.cached.generate(prompt_ids, GREEDY)
    assert cached.token_ids == smollm2.recompute.generate(prompt_ids, GREEDY).token_ids


SMOLLM2_QUESTIONS = [
    "What is the capital of France?",
    "Count from 1 to 10, separated by commas.",
    "What color is the sky on a clear day? Answer in one sentence.",
]


@pytest.mark.parametrize("question", SMOLLM2_QUESTIONS)
def test_smollm2_chat_greedy_equals_transformers(smollm2, question):
    prompt_ids = smollm2.chat_ids(question)
    ours = smollm2.cached.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=32))
    assert ours.token_ids == smollm2.transformers_greedy(prompt_ids, 32)
    assert ours.text.strip(), "a chat answer should not be empty"
    assert ours.text == smollm2.loaded.tokenizer.decode(ours.token_ids, skip_special_tokens=True)
    if "France" in question:
        assert "Paris" in ours.text
        assert ours.finish_reason == "stop", "a short answer ends with the end-of-turn token"


def test_gemma3_greedy_equals_transformers(gemma3):
    prompt_ids = gemma3.loaded.tokenizer.encode("The capital of France is", add_special_tokens=True)
    ours = gemma3.cached.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=32))
    assert ours.token_ids == gemma3.transformers_greedy(prompt_ids, 32)
