"""POST /v1/responses (OpenAI's Responses API) on a real server through the real `openai` client.

Oracles: the `openai` client's own types (`Response.model_validate` on the raw body, the typed
stream events, `responses.stream`'s assembly), our chat template rendered and tokenized by hand
(usage.input_tokens counts exactly the chat the request means), the chat route's greedy answer to
the same messages, and `jsonschema` for a forced call's arguments. SmolLM2 (ChatML, Hermes tool
calls) serves most tests; a tiny Qwen 3 whose greedy answer is a think block, then content, the
reasoning ones.
"""

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conformance.vlm.chat import client_of, data_url, png

from . import test_app_chat_tools, test_app_images
from .test_app_disconnect import counters, engine_idle, wait_until
from .test_app_errors import post

# The tiny Qwen 3 server of the chat tests: greedily, it answers THINKING_ANSWER.
qwen3_server = test_app_chat_tools.qwen3_server
THINKING_ANSWER = test_app_chat_tools.THINKING_ANSWER
# The random tiny Gemma 3 with a vision tower of the image tests, and its servers.
checkpoint = test_app_images.checkpoint
start_vlm_server = test_app_images.start_vlm_server
RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
# The same tool as chat (and the chat template) take it.
WEATHER_CHAT = {
    "type": "function",
    "function": {key: value for key, value in WEATHER.items() if key != "type"},
}
QUESTION = "What is the weather in Paris?"


def _prompt_tokens(loaded, messages, **render_kwargs) -> int:
    prompt = loaded.chat_template.render(messages, add_generation_prompt=True, **render_kwargs)
    return len(loaded.tokenizer.encode(prompt, add_special_tokens=False))


def _raw(server, **body) -> dict:
    """The raw JSON answer, parsed strictly by the client's own Response type."""
    response = post(server, RESPONSES, json={"model": server.model, **body})
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())
    return response.json()


# -- one body -------------------------------------------------------------------------------------


def test_a_string_input_is_the_chat_routes_greedy_answer_to_one_user_message(server, smollm2_loaded):
    client = server.openai_client()
    answer = client.responses.create(
        model=server.model, input="Say hello.", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    )
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.output_text == chat.choices[0].message.content
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens == _prompt_tokens(
        smollm2_loaded, [{"role": "user", "content": "Say hello."}]
    )
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens


def test_the_raw_body_is_a_response_by_the_clients_strict_types(server):
    body = _raw(server, input="Hi", max_output_tokens=3, metadata={"trace": "t-1"}, store=False)
    assert body["metadata"] == {"trace": "t-1"} and body["store"] is False
    assert body["output"][0]["content"][0]["type"] == "output_text"


def test_instructions_and_input_items_are_the_chat_messages_in_order(server, smollm2_loaded):
    answer = server.openai_client().responses.create(
        model=server.model,
        instructions="Answer in one word.",
        input=[
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Colour of the sky?"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
            {"role": "user", "content": "And grass?"},
        ],
        max_output_tokens=4,
    )
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
    ]
    assert answer.usage.input_tokens == _prompt_tokens(smollm2_loaded, messages)
    assert answer.instructions == "Answer in one word."


def test_an_answer_cut_by_max_output_tokens_is_incomplete(server):
    answer = server.openai_client().responses.create(
        model=server.model, input="Write a long story about a dragon.", max_output_tokens=5
    )
    assert answer.status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 5
    assert answer.output[-1].status == "incomplete"


def test_text_format_json_schema_holds_the_text_to_the_schema(server):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "country": {"type": "string", "maxLength": 12},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    answer = server.openai_client().responses.create(
        model=server.model,
        input="Give a city and its country.",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        max_output_tokens=80,
    )
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)


# -- tools ----------------------------------------------------------------------------------------


def _assert_weather_call(item) -> dict:
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_a_forced_tool_choice_answers_with_one_function_call(server, tool_choice):
    answer = server.openai_client().responses.create(
        model=server.model,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = answer.output
    _assert_weather_call(call)
    assert call.status == "completed" and answer.status == "completed"
    assert answer.tools[0].name == "get_weather"


def test_parallel_tool_calls_by_default_lets_a_forced_answer_hold_several_calls(server):
    """OpenAI's default: greedy SmolLM2 repeats a named forced call once the grammar lets it, and
    each call is an item of its own."""
    answer = server.openai_client().responses.create(
        model=server.model,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        temperature=0,
    )
    assert len(answer.output) >= 2 and answer.parallel_tool_calls is not False
    for call in answer.output:
        _assert_weather_call(call)


def test_a_function_call_output_round_trip_is_answered_and_counted_as_the_chat_rendering(
    server, smollm2_loaded
):
    client = server.openai_client()
    first = client.responses.create(
        model=server.model,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = first.output
    arguments = _assert_weather_call(call)
    # As an agent loop sends it: the SDK's dump of the call, then its output.
    second = client.responses.create(
        model=server.model,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
        ],
        tools=[WEATHER],
        max_output_tokens=20,
    )
    assert second.output[0].type == "message"
    messages = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'},
    ]
    # The arguments as the model wrote them (the template writes them as given).
    messages[1]["tool_calls"][0]["function"]["arguments"] = call.arguments
    assert second.usage.input_tokens == _prompt_tokens(smollm2_loaded, messages, tools=[WEATHER_CHAT])


def test_an_assistant_message_and_the_calls_after_it_are_one_chat_message(server, smollm2_loaded):
    # Two calls in one turn, with the text the model wrote before them, then their outputs.
    calls = [
        {
            "type": "function_call",
            "call_id": f"call_{city}",
            "name": "get_weather",
            "arguments": f'{{"city": "{city}"}}',
        }
        for city in ("Paris", "Rome")
    ]
    answer = server.openai_client().responses.create(
        model=server.model,
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Let me check."},
            *calls,
            *(
                {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
                for call in calls
            ),
        ],
        tools=[WEATHER],
        max_output_tokens=2,
    )
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
                for call in calls
            ],
        },
        *({"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"} for call in calls),
    ]
    assert answer.usage.input_tokens == _prompt_tokens(smollm2_loaded, messages, tools=[WEATHER_CHAT])


# -- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_an_input_image_is_answered_as_the_chat_routes_image_url(start_vlm_server, stream):
    from infer.server.media import MediaPolicy

    client = client_of(start_vlm_server(MediaPolicy()))
    url = data_url(png(50, 40, seed=7))
    chat = client.chat.completions.create(
        model="gemma3-vision-tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is it?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    request = {
        "model": "gemma3-vision-tiny",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is it?"},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
        "max_output_tokens": 8,
        "temperature": 0,
    }
    ours = (
        list(client.responses.create(stream=True, **request))[-1].response
        if stream
        else client.responses.create(**request)
    )
    assert ours.output_text == chat.choices[0].message.content
    assert ours.usage.input_tokens == chat.usage.prompt_tokens


def test_an_input_image_for_a_model_without_a_vision_tower_is_refused_naming_the_part(server):
    content = [
        {"type": "input_text", "text": "Hi"},
        {"type": "input_image", "image_url": data_url(png(8, 8, seed=1))},
    ]
    response = post(
        server,
        RESPONSES,
        json={"model": server.model, "instructions": "x", "input": [{"role": "user", "content": content}]},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input.0.content.1.image_url"
    assert "does not take images" in error["message"]


# -- previous_response_id -------------------------------------------------------------------------


def test_previous_response_id_continues_the_stored_conversation(server):
    client = server.openai_client()
    first = client.responses.create(
        model=server.model,
        instructions="You are terse.",
        input="My name is Ada. Say hi.",
        max_output_tokens=8,
        temperature=0,
    )
    second = client.responses.create(
        model=server.model, previous_response_id=first.id, input="What is my name?", max_output_tokens=4
    )
    # As OpenAI: the earlier turns are carried over, the earlier instructions are not.
    conversation = [
        {"role": "user", "content": "My name is Ada. Say hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    counted = post(server, "/tokenize", json={"model": server.model, "messages": conversation}).json()[
        "count"
    ]
    assert second.usage.input_tokens == counted
    assert second.previous_response_id == first.id
    # And the chain goes on.
    third = client.responses.create(
        model=server.model, previous_response_id=second.id, input="Thanks.", max_output_tokens=2
    )
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_function_call_output_continues_the_stored_call_by_previous_response_id(server, smollm2_loaded):
    # The agent loop as OpenAI's docs write it: only the call's output is sent back.
    client = server.openai_client()
    first = client.responses.create(
        model=server.model,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = first.output
    second = client.responses.create(
        model=server.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    tool_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert second.usage.input_tokens == _prompt_tokens(smollm2_loaded, messages, tools=[WEATHER_CHAT])


def test_a_response_with_store_false_is_not_kept(server):
    client = server.openai_client()
    unstored = client.responses.create(model=server.model, input="Hi", max_output_tokens=2, store=False)
    for response_id in (unstored.id, "resp_never_made"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model=server.model, previous_response_id=response_id, input="Again", max_output_tokens=2
            )
        error = caught.value.body
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_response_is_retrieved_and_deleted(server):
    client = server.openai_client()
    answer = client.responses.create(model=server.model, input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(answer.id).model_dump() == answer.model_dump()
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


def test_the_store_keeps_the_most_recently_used(server):
    from infer.server.responses_store import ResponseStore, StoredResponse

    store = ResponseStore(max_responses=2)
    for response_id in ("a", "b"):
        store.put(StoredResponse({"id": response_id, "output": []}, []))
    assert store.get("a") is not None  # now the newest
    store.put(StoredResponse({"id": "c", "output": []}, []))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a") is not None and store.get("c") is not None


# -- a stream -------------------------------------------------------------------------------------


def test_a_stream_is_typed_events_that_assemble_into_the_body(server):
    client = server.openai_client()
    request = {"model": server.model, "input": "Say hello.", "max_output_tokens": 12, "temperature": 0}
    events = list(client.responses.create(stream=True, **request))
    body = client.responses.create(**request)
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if body.status == "incomplete" else "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == body.output_text
    assert final.usage == body.usage and final.status == body.status
    # Each event line names its type, as OpenAI sends them, and each event is one of the client's
    # types, validated strictly (the stream parser itself is lenient).
    raw = httpx.post(server.base_url + RESPONSES, json={**request, "stream": True}, timeout=60.0).text
    blocks = [block for block in raw.split("\n\n") if block]
    for block in blocks:
        TypeAdapter(ResponseStreamEvent).validate_json(block.split("data: ", 1)[1])
    assert all(
        block.split("\n")[0] == f"event: {json.loads(block.split('data: ', 1)[1])['type']}"
        for block in blocks
    )


def test_the_stream_helper_assembles_a_forced_call(server):
    with server.openai_client().responses.stream(
        model=server.model,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    (call,) = final.output
    assert _assert_weather_call(call) == call.parsed_arguments
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    assert types[-1] == "response.completed"


def test_an_answer_the_engine_cannot_finish_ends_its_stream_with_response_failed():
    # What a stream sends when the server cancels its request (a drain's deadline) or the engine
    # fails: the builder's own events, validated by the client's types.
    from infer.server.errors import cancelled_by_server
    from infer.server.responses_output import ResponseBuilder

    echoed = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "parallel_tool_calls": True,
    }
    builder = ResponseBuilder({**echoed, "tool_choice": "auto", "tools": []}, None)
    events = builder.start() + builder.feed("Hel", 1) + builder.failed(cancelled_by_server())
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(event) for event in events]
    assert [event.type for event in parsed][-1] == "response.failed"
    assert parsed[-1].response.status == "failed" and parsed[-1].response.error.code == "server_error"
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))


# A forced string at least this long keeps SmolLM2 writing until the client hangs up.
LONG_ANSWER = {
    "format": {
        "type": "json_schema",
        "name": "story",
        "schema": {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 1500}},
            "required": ["story"],
        },
    }
}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_hanging_up_aborts_its_response(server, stream):
    wait_until(lambda: engine_idle(server), what="an idle engine before the test")
    disconnects, aborts = counters(server)
    body = {"model": server.model, "input": "Tell a story.", "text": LONG_ANSWER, "max_output_tokens": 400}
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        if stream:
            with client.stream("POST", RESPONSES, json={**body, "stream": True}) as response:
                lines = (line for line in response.iter_lines() if line.startswith("data:"))
                for _ in range(5):  # past the first text deltas: generating
                    next(lines)
                assert server.engine.stats().num_running == 1
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(RESPONSES, json=body, timeout=3.0)
    wait_until(lambda: engine_idle(server), what="the blocks freed after the disconnect")
    expected = (disconnects + 1, aborts + 1)
    wait_until(lambda: counters(server) == expected, timeout_s=5.0, what=f"counters {expected}")


# -- refusals -------------------------------------------------------------------------------------


def refusal(body: dict, code: str, param: str, status: int = 400):
    return pytest.param(body, status, code, param, id=f"{status}-{code}-{param}")


HI = {"input": "Hi"}
REFUSALS = [
    refusal({**HI, "tools": [{"type": "web_search"}]}, "unsupported_value", "tools.0.type"),
    refusal(
        {**HI, "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
        "unsupported_value",
        "tools.0.type",
    ),
    refusal({**HI, "tools": [{"type": "mcp", "server_label": "x"}]}, "unsupported_value", "tools.0.type"),
    refusal({**HI, "tool_choice": {"type": "file_search"}}, "unsupported_value", "tool_choice"),
    refusal({**HI, "background": True}, "unsupported_value", "background"),
    refusal({**HI, "include": ["reasoning.encrypted_content"]}, "unsupported_value", "include"),
    refusal({**HI, "truncation": "auto"}, "unsupported_value", "truncation"),
    refusal({**HI, "conversation": "conv_1"}, "unsupported_value", "conversation"),
    refusal({**HI, "reasoning": {"summary": "detailed"}}, "unsupported_value", "reasoning.summary"),
    refusal({**HI, "top_logprobs": 3}, "unsupported_value", "top_logprobs"),
    refusal({**HI, "text": {"verbosity": "low"}}, "unsupported_value", "text.verbosity"),
    refusal(
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
        "unsupported_value",
        "input.0.content.0.type",
    ),
    refusal(
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
        "unsupported_value",
        "input.0.content.0.file_id",
    ),
    refusal({"input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_value", "input.0.type"),
    refusal(
        {"input": [{"type": "function_call_output", "output": "1"}]},
        "missing_required_parameter",
        "input.0.call_id",
    ),
    refusal({"input": [{"role": "tool", "content": "1"}]}, "invalid_value", "input.0.role"),
    refusal({"input": []}, "empty_input", "input"),
    refusal({}, "missing_required_parameter", "input"),
    refusal({**HI, "max_tokens": 4}, "unknown_parameter", "max_tokens"),
    refusal({**HI, "temperature": 3}, "invalid_value", "temperature"),
    refusal(
        {**HI, "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
        "invalid_value",
        "tools.0.parameters",
    ),
    refusal(
        {
            **HI,
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"},
        },
        "invalid_value",
        "tool_choice.name",
    ),
    refusal({**HI, "tool_choice": "required"}, "invalid_value", "tool_choice"),
    refusal(
        {**HI, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
        "unsupported_value",
        "text.format",
    ),
    refusal({**HI, "reasoning": {"effort": "huge"}}, "invalid_value", "reasoning.effort"),
    refusal({"input": "hello " * 2000}, "context_length_exceeded", "input"),
    refusal({**HI, "previous_response_id": "resp_x"}, "previous_response_not_found", "previous_response_id"),
    refusal({**HI, "model": "no-such-model"}, "model_not_found", "model", status=404),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), REFUSALS)
def test_what_is_not_done_here_is_refused_naming_the_field(server, body, status, code, param):
    response = post(server, RESPONSES, json={"model": server.model, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    if code in ("unsupported_value", "invalid_value"):
        assert param in error["message"], error


# -- reasoning, on a tiny Qwen 3 whose greedy answer is known -------------------------------------


def _qwen3_response(background, **options):
    client = openai.OpenAI(api_key="unused", base_url=f"{background.base_url}/v1", max_retries=0)
    return client.responses.create(
        model="qwen3-tiny", input=QUESTION, max_output_tokens=16, temperature=0, **options
    )


def test_a_thinking_models_reasoning_is_a_reasoning_item_before_the_message(qwen3_server):
    background, _ = qwen3_server
    assert THINKING_ANSWER[:4] == ["<think>", "H", "m", "</think>"]
    answer = _qwen3_response(background, reasoning={"effort": "high"})
    reasoning, message = answer.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [part.text for part in reasoning.content] == ["Hm"] and reasoning.summary == []
    assert message.type == "message" and answer.output_text == "OK"
    # <think>, H and m wrote the reasoning text.
    assert answer.usage.output_tokens_details.reasoning_tokens == 3


def test_streamed_reasoning_is_the_same_items_and_count(qwen3_server):
    background, _ = qwen3_server
    events = list(_qwen3_response(background, stream=True))
    body = _qwen3_response(background)
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert reasoning == "Hm"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == body.output_text and final.usage == body.usage


def test_effort_none_turns_thinking_off(qwen3_server):
    background, _ = qwen3_server
    answer = _qwen3_response(background, reasoning={"effort": "none"})
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == "<think>Hm</think>OK"
    assert answer.usage.output_tokens_details.reasoning_tokens == 0
