"""POST /v1/completions on a real server, through the real `openai` client.

Oracle: greedy `conformance.oracles.RecomputeOracle` on the same model and the same prompt ids
(one request, no cache, no batching, no server): the server's greedy answer must be the same tokens.
"""

import pytest

from conformance.oracles import RecomputeOracle
from infer.engine import SamplingParams
from infer.server.schemas import CompletionRequest


@pytest.fixture(scope="module")
def oracle(smollm2_loaded) -> RecomputeOracle:
    return RecomputeOracle(smollm2_loaded)


def greedy(oracle, smollm2_loaded, prompt: str, **params):
    prompt_ids = smollm2_loaded.tokenizer.encode(prompt, add_special_tokens=True)
    return prompt_ids, oracle.generate(prompt_ids, SamplingParams(temperature=0, **params))


def test_greedy_completion_equals_single_request_generation(server, oracle, smollm2_loaded):
    prompt_ids, expected = greedy(oracle, smollm2_loaded, "The capital of France is", max_new_tokens=12)
    answer = server.openai_client().completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    choice = answer.choices[0]
    assert choice.text == expected.text
    assert choice.token_ids == expected.token_ids
    assert choice.finish_reason == expected.finish_reason
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == len(expected.token_ids)
    assert answer.id.startswith("cmpl-") and answer.model == server.model


def test_stream_is_the_greedy_answer_in_pieces_with_one_terminal_chunk(server, oracle, smollm2_loaded):
    prompt_ids, expected = greedy(oracle, smollm2_loaded, "Once upon a time", max_new_tokens=10)
    chunks = list(
        server.openai_client().completions.create(
            model=server.model,
            prompt="Once upon a time",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *pieces, usage_chunk = chunks
    finishing = [chunk for chunk in pieces if chunk.choices[0].finish_reason is not None]
    assert finishing == [pieces[-1]], "exactly one chunk carries finish_reason, and it is the last"
    assert pieces[-1].choices[0].finish_reason == expected.finish_reason
    assert "".join(chunk.choices[0].text for chunk in pieces) == expected.text
    assert [i for chunk in pieces for i in chunk.choices[0].token_ids] == expected.token_ids
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == len(prompt_ids)
    assert usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert len({chunk.id for chunk in chunks}) == 1


def test_token_id_prompt_is_fed_as_given(server, oracle):
    prompt_ids = [504, 3575, 282, 4649, 314]
    expected = oracle.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=4))
    answer = server.openai_client().completions.create(
        model=server.model, prompt=prompt_ids, max_tokens=4, temperature=0
    )
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.choices[0].token_ids == expected.token_ids


def test_stop_string_ends_the_answer_without_the_stop_text(server, oracle, smollm2_loaded):
    _, expected = greedy(oracle, smollm2_loaded, "List three fruits:\n1.", max_new_tokens=40, stop=["\n"])
    answer = server.openai_client().completions.create(
        model=server.model, prompt="List three fruits:\n1.", max_tokens=40, temperature=0, stop="\n"
    )
    assert answer.choices[0].text == expected.text
    assert "\n" not in answer.choices[0].text
    assert answer.choices[0].finish_reason == expected.finish_reason == "stop"


def test_seeded_sampling_repeats_and_defaults_to_sixteen_tokens(server):
    client = server.openai_client()
    answers = [
        client.completions.create(
            model=server.model, prompt="The sky is", temperature=1.0, top_p=0.9, seed=1234
        )
        for _ in range(2)
    ]
    assert answers[0].choices[0].text == answers[1].choices[0].text
    default_max_tokens = CompletionRequest.model_fields["max_tokens"].default
    assert answers[0].usage.completion_tokens <= default_max_tokens
