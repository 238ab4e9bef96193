"""OpenAI-valid input that a server must take (issue 14), on a real server through the official
`openai` client or raw JSON where the client would not send it as is."""

import collections
import functools
import inspect
import json
import logging
import typing

import httpx
import openai
import pytest
from pydantic import BaseModel

from infer.server.schemas import ChatCompletionRequest, CompletionRequest

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


# -- null for every optional field (issue 14) -----------------------------------------------------
#
# The fields come from the request models themselves, nested objects included, so a field added
# later is covered too. Oracle: OpenAI's rule that null means "not sent", so each request must
# give the answer of the same request without the field (greedy, or seeded where the field under
# test is temperature); where null has a meaning of its own the answer is that meaning's.

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE_BODIES = {
    COMPLETIONS: {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "seed": 1},
    CHAT: {"messages": HI, "max_tokens": 2, "temperature": 0, "seed": 1},
}
# Each nested object below holds only its required fields, so "without" means without the field.
WEATHER_FUNCTION = {"name": "get_weather"}


def _in_assistant_message(fields: dict) -> dict:
    history = [*HI, {"role": "assistant", "content": "Paris.", **fields}]
    return {"messages": [*history, {"role": "user", "content": "And of Italy?"}]}


def _in_tool_call(fields: dict) -> dict:
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": "{}"}, **fields}
    return {
        "messages": [
            *HI,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": WEATHER_FUNCTION}],
    }


def _in_function(fields: dict) -> dict:
    return {"tools": [{"type": "function", "function": {**WEATHER_FUNCTION, **fields}}]}


def _in_stream_options(fields: dict) -> dict:
    return {"stream": True, "stream_options": {**fields}}


def _in_response_format(fields: dict) -> dict:
    return {"response_format": {"type": "text", **fields}}


def _in_json_schema(fields: dict) -> dict:
    # The schema in the first design document's place, so that json_schema holds only its name.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return {
        "response_format": {"type": "json_schema", "schema": schema, "json_schema": {"name": "x", **fields}}
    }


# Where an object of each nested request model sits in a body: (endpoints, the body's fields with
# that object holding `fields`).
def _in_structured_outputs(fields: dict) -> dict:
    # vLLM's object, with the one constraint it must hold (so `choice` is not optional here).
    return {"structured_outputs": {"choice": ["yes", "no"], **fields}}


NESTED_PLACES = {
    "ChatMessage": ([CHAT], _in_assistant_message),
    "ToolCall": ([CHAT], _in_tool_call),
    "FunctionDefinition": ([CHAT], _in_function),
    "StreamOptions": ([COMPLETIONS, CHAT], _in_stream_options),
    "ResponseFormat": ([COMPLETIONS, CHAT], _in_response_format),
    "JsonSchemaFormat": ([COMPLETIONS, CHAT], _in_json_schema),
    "StructuredOutputs": ([COMPLETIONS, CHAT], _in_structured_outputs),
}
# Nested objects whose null cases need a server of another model: name -> where they are sent.
NULL_CASES_ELSEWHERE = {"ImageUrl": "test_app_images.py, on a model with a vision tower"}
# A message without content is an assistant's tool call (_in_tool_call sends one) or a 400, as
# OpenAI has it; structured_outputs without its one constraint is a 400.
NULL_IS_NOT_THE_DEFAULT = {("ChatMessage", "content"), ("StructuredOutputs", "choice")}


REQUEST_MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}


def _nested_models(model) -> dict:
    """Every request model reachable from `model`'s fields, by name."""
    found = {}

    def visit(annotation) -> None:
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if is_model and annotation.__name__ not in found:
            found[annotation.__name__] = annotation
            for field in annotation.model_fields.values():
                visit(field.annotation)
        for argument in typing.get_args(annotation):
            visit(argument)

    for field in model.model_fields.values():
        visit(field.annotation)
    return found


def _json_fields(model) -> dict:
    """The model's fields by the names a body uses (a field's alias where it has one)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _optional_fields(model) -> list[str]:
    return [name for name, field in _json_fields(model).items() if not field.is_required()]


def _null_means_not_sent(model, name: str) -> bool:
    """False where null is a value of its own: the field takes None and defaults to something
    else (a completion's max_tokens: null is as many as fit, the default 16)."""
    if (model.__name__, name) in NULL_IS_NOT_THE_DEFAULT:
        return False
    field = _json_fields(model)[name]
    takes_none = type(None) in typing.get_args(field.annotation) or field.annotation is typing.Any
    return not takes_none or field.get_default(call_default_factory=True) is None


def _null_cases():
    """(endpoint, body with the field null, body without it) for every optional field."""
    cases = []
    for endpoint, model in REQUEST_MODELS.items():
        base = BASE_BODIES[endpoint]
        for field in filter(functools.partial(_null_means_not_sent, model), _optional_fields(model)):
            without = {key: value for key, value in base.items() if key != field}
            cases.append(pytest.param(endpoint, {**base, field: None}, without, id=f"{endpoint}:{field}"))
        for name, nested in _nested_models(model).items():
            endpoints, place = NESTED_PLACES.get(name, ([], None))
            if endpoint not in endpoints:
                continue
            for field in filter(functools.partial(_null_means_not_sent, nested), _optional_fields(nested)):
                with_null, without = {**base, **place({field: None})}, {**base, **place({})}
                cases.append(pytest.param(endpoint, with_null, without, id=f"{endpoint}:{name}.{field}"))
    return cases


def test_every_nested_request_object_with_optional_fields_has_a_place_in_the_null_cases():
    for endpoint, model in REQUEST_MODELS.items():
        for name, nested in _nested_models(model).items():
            if _optional_fields(nested) and name not in NULL_CASES_ELSEWHERE:
                assert endpoint in NESTED_PLACES.get(name, ([], None))[0], (
                    f"{name} (in {endpoint}) has optional fields; add it to NESTED_PLACES"
                )


def _answer(server, endpoint: str, body: dict) -> dict:
    """What an answer says, without its id, time and tool call ids: each choice's text (or
    message), finish reason and tokens, and the usage; a stream's joined the same way. Answers
    are deterministic (greedy or seeded): each body is sent once per server."""
    return json.loads(_answer_json(server.base_url, server.model, endpoint, json.dumps(body)))


@functools.cache
def _answer_json(base_url: str, model: str, endpoint: str, body_json: str) -> str:
    body = {"model": model, **json.loads(body_json)}
    choices, usage = collections.defaultdict(dict), None
    if body.get("stream"):
        with httpx.stream("POST", base_url + endpoint, json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            events = [
                line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]"
        for chunk in map(json.loads, events[:-1]):
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if endpoint == CHAT else choice["text"]
                entry = choices[choice["index"]]
                entry["text"] = entry.get("text", "") + (piece or "")
                entry["finish_reason"] = choice["finish_reason"] or entry.get("finish_reason")
        return json.dumps({"choices": choices, "usage": usage})
    response = httpx.post(base_url + endpoint, json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    for choice in answer["choices"]:
        for call in choice.get("message", {}).get("tool_calls") or []:
            call["id"] = "call_*"  # a new random id in every answer
    return json.dumps({"choices": answer["choices"], "usage": answer["usage"]})


@pytest.mark.parametrize(("endpoint", "with_null", "without"), _null_cases())
def test_null_for_an_optional_field_answers_as_if_it_was_not_sent(server, endpoint, with_null, without):
    assert _answer(server, endpoint, with_null) == _answer(server, endpoint, without)


def test_null_max_tokens_of_a_completion_means_what_the_context_leaves(server):
    # OpenAI's legacy completions default to 16 tokens; null means as many as fit.
    prompt = [1] * (server.engine.max_seq_len - 3)
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    null = _answer(server, COMPLETIONS, {**body, "max_tokens": None})
    assert null == _answer(server, COMPLETIONS, {**body, "max_tokens": 3})
    assert null["usage"]["completion_tokens"] == 3


# -- OpenAI's metadata fields: accepted, ignored, logged at debug (issue 14) ----------------------

# Each field as a client sends it, as body fields; the name the debug log must give it.
METADATA_FIELDS = {
    "store": {"store": False},
    "metadata": {"metadata": {"run": "test"}},
    "service_tier": {"service_tier": "auto"},
    "safety_identifier": {"safety_identifier": "abc"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "user": {"user": "someone"},
    "stream_options.include_obfuscation": {"stream": True, "stream_options": {"include_obfuscation": False}},
}


def _debug_records(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "infer.server.schemas" and record.levelno == logging.DEBUG
    ]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("name", list(METADATA_FIELDS))
def test_each_openai_metadata_field_is_logged_at_debug_by_its_name(server, caplog, endpoint, name):
    body = {"model": server.model, **BASE_BODIES[endpoint], **METADATA_FIELDS[name]}
    with caplog.at_level(logging.DEBUG, logger="infer.server.schemas"):
        response = httpx.post(server.base_url + endpoint, json=body, timeout=60)
    assert response.status_code == 200, response.text
    [logged] = _debug_records(caplog)
    named = {field for field in METADATA_FIELDS if repr(field) in logged}  # the log lists them quoted
    assert named == {name}, logged


def test_a_request_without_metadata_fields_logs_none(server, caplog):
    body = {"model": server.model, **BASE_BODIES[CHAT]}
    with caplog.at_level(logging.DEBUG, logger="infer.server.schemas"):
        response = httpx.post(server.base_url + CHAT, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert _debug_records(caplog) == []


# -- the official client, for each input of issue 14 ----------------------------------------------


def test_max_completion_tokens_through_the_openai_client_cuts_the_greedy_answer(server):
    client = server.openai_client()
    settings = dict(model=server.model, messages=[{"role": "user", "content": "Say hi."}], temperature=0)
    whole = client.chat.completions.create(**settings, max_tokens=32).choices[0]
    assert len(whole.token_ids) > 5
    cut = client.chat.completions.create(**settings, max_completion_tokens=5)
    assert (cut.usage.completion_tokens, cut.choices[0].finish_reason) == (5, "length")
    assert cut.choices[0].token_ids == whole.token_ids[:5]


def test_a_negative_seed_through_the_openai_client_seeds_sampling(server):
    # OpenAI takes any int64 seed; a seed, negative or not, makes sampling repeat itself.
    client = server.openai_client()

    def sample(seed: int) -> list[int]:
        answer = client.chat.completions.create(
            model=server.model, messages=HI, max_tokens=12, temperature=1.0, seed=seed
        )
        return answer.choices[0].token_ids

    assert sample(-5) == sample(-5)
    assert len({tuple(sample(seed)) for seed in (-5, -6, -7)}) > 1


def test_a_developer_message_through_the_openai_client_is_a_system_message(server):
    client = server.openai_client()

    def ask(role: str):
        messages = [{"role": role, "content": "Answer in one word."}, *HI]
        return client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=8, temperature=0
        )

    developer, system = ask("developer"), ask("system")
    assert developer.choices[0].token_ids == system.choices[0].token_ids
    assert developer.usage == system.usage


def test_openai_metadata_fields_through_the_openai_client_change_nothing(server):
    client = server.openai_client()
    settings = dict(model=server.model, messages=HI, max_tokens=8, temperature=0)
    metadata = dict(
        store=False,
        metadata={"run": "test"},
        service_tier="auto",
        safety_identifier="abc",
        prompt_cache_key="k",
        user="someone",
    )
    plain = client.chat.completions.create(**settings)
    tagged = client.chat.completions.create(**settings, **metadata)
    assert tagged.choices[0].token_ids == plain.choices[0].token_ids and tagged.usage == plain.usage
    stream_options = {"include_usage": True, "include_obfuscation": False}
    stream = client.chat.completions.create(
        **settings, **metadata, stream=True, stream_options=stream_options
    )
    chunks = list(stream)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == plain.choices[0].message.content and chunks[-1].usage == plain.usage


def _client_sending_nulls(server, sent: list) -> openai.OpenAI:
    """server's client, each request body it sends appended to `sent` (to see the nulls go out)."""

    def keep_body(request: httpx.Request) -> None:
        sent.append(json.loads(request.read()))

    http_client = httpx.Client(event_hooks={"request": [keep_body]}, timeout=60.0)
    return openai.OpenAI(
        api_key="unused", base_url=f"{server.base_url}/v1", max_retries=0, http_client=http_client
    )


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_none_for_every_optional_parameter_of_the_openai_client_means_its_default(server, endpoint):
    """The client sends None as null. Every parameter the client and the request model share is
    None but `seed` (the answer is sampled at the default temperature, so seeded to compare) and
    the token limit (a completion's null max_tokens is a limit of its own)."""
    sent: list[dict] = []
    client = _client_sending_nulls(server, sent)
    create = client.completions.create if endpoint == COMPLETIONS else client.chat.completions.create
    model = REQUEST_MODELS[endpoint]
    shared = set(inspect.signature(create).parameters) & set(_optional_fields(model))
    nulls = {name: None for name in sorted(shared - {"seed", "max_tokens"})}
    assert {"temperature", "top_p", "stream", "n", "stop", "logit_bias"} <= set(nulls)
    fixed = {"seed": 7, "max_tokens": 6}
    if endpoint == COMPLETIONS:
        fixed["prompt"] = "Once upon a time"
    else:
        fixed["messages"] = HI
    with_nulls = create(model=server.model, **fixed, **nulls)
    assert {name: sent[-1][name] for name in nulls} == nulls, "the client sent the nulls"
    without = create(model=server.model, **fixed)
    assert with_nulls.choices[0].token_ids == without.choices[0].token_ids
    assert with_nulls.usage == without.usage


@pytest.mark.parametrize("temperature", [1e-37, 1e-300])
def test_a_tiny_temperature_is_greedy_and_leaves_a_concurrent_request_alone(server, temperature):
    """Issue 14: 1e-37 made NaN in the sampler and failed every request of its step; 1e-300
    sampled as if it were 1.0. Oracles: the greedy answer (which sampling at 1.0 with the same
    seed is not), and the neighbour's answer when it runs alone (seeded, so the same tokens)."""
    client = server.openai_client()
    # Logits above 40 here: divided by 1e-37 they overflow float32, as the did.
    question = dict(model=server.model, prompt="one one one one one one one one", max_tokens=8, seed=3)
    greedy = client.completions.create(**question, temperature=0).choices[0].text
    assert client.completions.create(**question, temperature=1.0).choices[0].text != greedy
    neighbour = dict(
        model=server.model,
        prompt="The weather today",
        max_tokens=32,
        temperature=1.0,
        top_p=0.9,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    alone = client.completions.create(**neighbour).choices[0].text
    with client.completions.create(**neighbour, stream=True) as stream:
        chunks = iter(stream)
        first = next(chunks)  # the neighbour is running: the tiny temperature shares its steps
        tiny = client.completions.create(**question, temperature=temperature)
        rest = list(chunks)
    assert tiny.choices[0].text == greedy
    assert "".join(chunk.choices[0].text for chunk in [first, *rest] if chunk.choices) == alone
    assert rest[-1].choices[0].finish_reason == "length"
