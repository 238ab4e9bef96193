"""POST /v1/chat/completions on a real server, through the real `openai` client.

Oracle: our chat template rendered and tokenized by hand, then greedy single-request generation.
"""

import pytest

from conformance.oracles import RecomputeOracle
from infer.engine import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def expected(smollm2_loaded):
    """(prompt ids, greedy result) for QUESTION, with room to reach the end of the turn."""
    prompt = smollm2_loaded.chat_template.render(QUESTION, add_generation_prompt=True)
    prompt_ids = smollm2_loaded.tokenizer.encode(prompt, add_special_tokens=False)
    oracle = RecomputeOracle(smollm2_loaded)
    return prompt_ids, oracle.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=48))


def test_engine_stops_at_the_templates_end_of_turn_token(server, smollm2_loaded):
    end_of_turn = smollm2_loaded.tokenizer.token_id(smollm2_loaded.chat_template.end_of_turn_token)
    assert end_of_turn is not None and end_of_turn in server.engine.eos_token_ids


def test_greedy_chat_answer_equals_template_plus_single_request_generation(server, expected):
    prompt_ids, result = expected
    assert result.finish_reason == "stop", "the oracle should end its turn within 48 tokens"
    answer = server.openai_client().chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=48, temperature=0
    )
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == result.text
    assert choice.finish_reason == "stop"
    assert answer.usage.prompt_tokens == len(prompt_ids), "usage counts exactly the tokens fed to the model"
    assert answer.usage.completion_tokens == len(result.token_ids)
    assert answer.id.startswith("chatcmpl-")


def test_chat_stream_role_first_then_content_then_one_finish(server, expected):
    prompt_ids, result = expected
    chunks = list(
        server.openai_client().chat.completions.create(
            model=server.model,
            messages=QUESTION,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *pieces, usage_chunk = chunks
    assert pieces[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.role is None for chunk in pieces[1:])
    assert [chunk.choices[0].finish_reason for chunk in pieces].count("stop") == 1
    assert pieces[-1].choices[0].finish_reason == "stop"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in pieces) == result.text
    assert usage_chunk.usage.prompt_tokens == len(prompt_ids)
    assert usage_chunk.usage.completion_tokens == len(result.token_ids)


def test_content_parts_mean_the_joined_string(server):
    client = server.openai_client()
    as_string = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
    )
    as_parts = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        max_tokens=8,
        temperature=0,
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage == as_string.usage
