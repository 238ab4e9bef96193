"""Generation through the engine core (`infer.engine.generate` / `stream`): against the recompute
oracle (no cache: the whole sequence every step), and greedy output against transformers.

Oracles: `conformance.oracles.RecomputeOracle` for the cache, and transformers' eager `generate`
for the model, sampler and stop loop together. (Per-step logits of the paged cache against a
cache-free forward are checked at the model level, infer-models' test_greedy.py.)
"""

import pytest

from infer.engine import RequestTooLongError, SamplingParams, stream

from .conftest import TINY_PRESETS

GREEDY = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
TINY_GREEDY = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_kv_cache_greedy_equals_recompute_greedy(tiny_models, preset):
    model = tiny_models[preset]
    prompt_ids = [5, 91, 200, 17, 300, 42, 7]
    cached = model.generate(prompt_ids, TINY_GREEDY)
    assert len(cached.token_ids) == 32 and cached.finish_reason == "length"
    assert cached.token_ids == model.oracle.generate(prompt_ids, TINY_GREEDY).token_ids


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
def test_the_oracles_answer_is_its_own_whatever_the_proposal(tiny_models, seed):
    oracle = tiny_models["llama-tiny"].oracle
    prompt_ids = [5, 91, 200, 17]
    params = SamplingParams(
        temperature=0 if seed is None else 1.0, max_new_tokens=16, seed=seed, ignore_eos=True
    )
    alone = oracle.generate(prompt_ids, params)
    right = alone.token_ids
    wrong = [token ^ 1 for token in right]
    for proposal in (right, right[:5], right[:5] + wrong[5:], wrong, right + [1, 2, 3]):
        assert oracle.generate(prompt_ids, params, proposal=proposal) == alone, proposal


def test_cache_is_reused_across_requests_of_different_lengths(tiny_models):
    model = tiny_models["llama-tiny"]
    long_prompt, short_prompt = list(range(10, 60)), [3, 4, 5]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    model.generate(long_prompt, params)
    # The short request runs on a cache holding the long one's stale keys.
    assert model.generate(short_prompt, params) == model.oracle.generate(short_prompt, params)


def test_seeded_sampling_repeats_and_seeds_differ(tiny_models):
    # llama-tiny's logits are the least peaked of the tiny presets, so draws vary with the seed.
    model = tiny_models["llama-tiny"]
    prompt_ids = [1, 2, 3]

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=16, seed=seed, ignore_eos=True)
        return model.generate(prompt_ids, params).token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_every_chunk_but_the_last_is_unfinished(tiny_models):
    model = tiny_models["gemma3-tiny"]
    chunks = list(stream(model.engine, [2, 50, 60], SamplingParams(max_new_tokens=5, seed=0)))
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason in ("stop", "length")


def test_prompt_and_max_new_tokens_beyond_max_seq_len_are_rejected_naming_the_limit(tiny_models):
    model = tiny_models["llama-tiny"]
    max_seq_len = model.engine.max_seq_len
    with pytest.raises(RequestTooLongError, match="max_seq_len"):
        model.generate([1] * (max_seq_len - 3), GREEDY)


def test_a_request_that_exactly_fills_max_seq_len_runs_to_its_length(tiny_models):
    model = tiny_models["llama-tiny"]
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    result = model.generate([1] * (model.engine.max_seq_len - 3), params)
    assert (len(result.token_ids), result.finish_reason) == (3, "length")


@pytest.mark.slow
def test_kv_cache_greedy_equals_recompute_on_smollm2(smollm2):
    prompt_ids = smollm2.chat_ids("Write a short story about a robot who learns to paint.")
    cached = smollm2.generate(prompt_ids, GREEDY)
    # The oracle checks the cached answer in one forward (RecomputeOracle.generate's proposal).
    expected = smollm2.oracle.generate(prompt_ids, GREEDY, proposal=cached.token_ids)
    assert cached.token_ids == expected.token_ids


SMOLLM2_QUESTIONS = [
    "What is the capital of France?",
    "Count from 1 to 10, separated by commas.",
    "What color is the sky on a clear day? Answer in one sentence.",
]


@pytest.mark.parametrize("question", SMOLLM2_QUESTIONS)
def test_smollm2_chat_greedy_equals_transformers(smollm2, question):
    prompt_ids = smollm2.chat_ids(question)
    ours = smollm2.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=32))
    assert ours.token_ids == smollm2.transformers_greedy(prompt_ids, 32)
    assert ours.text.strip(), "a chat answer should not be empty"
    assert ours.text == smollm2.loaded.tokenizer.decode(ours.token_ids, skip_special_tokens=True)
    if "France" in question:
        assert "Paris" in ours.text
        assert ours.finish_reason == "stop", "a short answer ends with the end-of-turn token"


def test_gemma3_greedy_equals_transformers(gemma3):
    prompt_ids = gemma3.loaded.tokenizer.encode("The capital of France is", add_special_tokens=True)
    ours = gemma3.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=32))
    assert ours.token_ids == gemma3.transformers_greedy(prompt_ids, 32)
