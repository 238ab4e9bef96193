"""OpenAI-valid input that a server must take (issue 14), on a real server through the official
`openai` client or raw JSON where the client would not send it as is."""

import httpx
import openai
import pytest

HI = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_retrieve_gives_the_served_model_and_404_for_another(server):
    client = server.openai_client()
    model = client.models.retrieve(server.model)
    assert (model.id, model.object, model.model_extra["max_model_len"]) == (
        server.model,
        "model",
        server.engine.max_seq_len,
    )
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_an_empty_text_prompt_generates(server):
    completion = server.openai_client().completions.create(model=server.model, prompt="", max_tokens=3)
    assert completion.usage.prompt_tokens == 1 and completion.usage.completion_tokens == 3


def test_nulls_negative_seed_developer_role_and_metadata_in_one_raw_request(server):
    body = {
        "model": server.model,
        "messages": [{"role": "developer", "content": "Answer in one word."}, *HI],
        "temperature": None,
        "top_p": None,
        "stream": None,
        "seed": -7,
        "max_tokens": 4,
        "store": False,
        "metadata": {"run": "test"},
        "service_tier": "auto",
        "safety_identifier": "abc",
        "prompt_cache_key": "k",
        "user": "someone",
    }
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 4
    message = response.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None, "OpenAI's schema requires refusal"


def test_a_conversation_resent_as_the_sdk_dumps_it_continues(server):
    """The round trip every agent loop does: the assistant message goes back with
    `message.model_dump()` (refusal, audio, function_call, annotations set to null)."""
    client = server.openai_client()
    first = client.chat.completions.create(model=server.model, messages=HI, max_tokens=8, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call"} <= set(dumped)
    follow_up = [*HI, dumped, {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(
        model=server.model, messages=follow_up, max_tokens=8, temperature=0
    )
    assert second.choices[0].message.content
