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


def test_logit_bias_forces_and_bans_tokens_through_the_openai_client(server):
    """+100 all but forces a token and -100 bans one, at temperature 0 too (OpenAI's semantics);
    the oracle is the tokenizer's own id for the text."""
    client = server.openai_client()
    tokenizer = server.engine.tokenizer
    [paris] = tokenizer.encode(" Paris", add_special_tokens=False)
    forced = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(paris): 100}
    )
    assert forced.choices[0].text == " Paris" * 3
    plain = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=1, temperature=0
    )
    [first] = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)
    banned = client.completions.create(
        model=server.model,
        prompt="The capital of France is",
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
    )
    assert banned.choices[0].text != plain.choices[0].text


def test_logit_bias_for_an_id_outside_the_vocabulary_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.openai_client().completions.create(
            model=server.model, prompt="Hi", max_tokens=1, logit_bias={str(10**9): 1}
        )
    assert caught.value.body["param"] == "logit_bias"


def test_presence_and_frequency_penalties_are_taken_and_change_a_repetitive_answer(server):
    client = server.openai_client()
    prompt = "one one one one one one one one"
    kwargs = dict(
        model=server.model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    plain = client.completions.create(**kwargs)
    penalized = client.completions.create(**kwargs, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized.usage.completion_tokens == 12
    assert penalized.choices[0].text != plain.choices[0].text


def test_min_tokens_defers_the_end_and_above_the_token_limit_is_a_400(server):
    client = server.openai_client()
    tokenizer = server.engine.tokenizer
    plain = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    [first] = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[:1]
    # The first greedy token as a stop token ends the answer at once, unless min_tokens defers it.
    kwargs = dict(model=server.model, prompt="The capital of France is", max_tokens=4, temperature=0)
    stopped = client.completions.create(**kwargs, extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(**kwargs, extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**kwargs, extra_body={"min_tokens": 5})
    assert caught.value.body["param"] == "min_tokens"
