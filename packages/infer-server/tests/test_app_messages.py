"""POST /v1/messages (Anthropic's Messages API) on a real server on 127.0.0.1, through the real
`anthropic` client (base_url = the server's root, as vLLM and llama.cpp are reached).

Oracles: /v1/chat/completions on the same server for the same conversation (the translation
must give the same prompt and the same greedy answer: text, tool calls, token counts), the
Anthropic SDK's own types and its stream accumulator (`messages.stream(...).get_final_message()`),
`jsonschema` for tool inputs, and raw SSE read with httpx for the event order.
"""

import base64
import json
import socket
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from .test_app_disconnect import counters, engine_idle, wait_until

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}
SYSTEM = "You are a terse assistant."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # the SDK's create() has no temperature argument: sent as extra_body


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)


def create(server, **request) -> anthropic.types.Message:
    request = {"model": server.model, "max_tokens": 24, **request}
    return client(server).messages.create(**request, extra_body=GREEDY)


def chat(server, messages, **options):
    return server.openai_client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, **options
    )


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_text_and_usage_equal_the_chat_routes_for_the_same_conversation(server):
    message = create(server, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    expected = chat(
        server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], max_tokens=24
    )
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == server.model
    assert text_of(message) == expected.choices[0].message.content
    assert [block.type for block in message.content] == ["text"]
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens
    reasons = {"stop": "end_turn", "length": "max_tokens"}
    assert message.stop_reason == reasons[expected.choices[0].finish_reason]
    assert message.stop_sequence is None


def test_system_text_blocks_read_as_the_system_string_and_a_different_system_changes_the_prompt(server):
    asked = [{"role": "user", "content": QUESTION}]
    as_string = create(server, system=SYSTEM, messages=asked)
    as_blocks = create(
        server,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=asked,
    )
    without = create(server, messages=asked)
    assert text_of(as_blocks) == text_of(as_string)
    assert as_blocks.usage.input_tokens == as_string.usage.input_tokens
    assert without.usage.input_tokens != as_string.usage.input_tokens


def test_the_token_limit_ends_the_message_with_max_tokens(server):
    message = create(server, messages=[{"role": "user", "content": "Write a long story."}], max_tokens=3)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3


def test_a_stop_sequence_cuts_the_text_before_it_and_is_named(server):
    asked = [{"role": "user", "content": QUESTION}]
    whole = text_of(create(server, messages=asked))
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[2]  # a word the greedy answer does write
    message = create(server, messages=asked, stop_sequences=["never-written-xyz", stop])
    assert text_of(message) == whole[: whole.find(stop)]
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    with client(server).messages.stream(
        model=server.model, max_tokens=24, messages=asked, stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert text_of(streamed) == text_of(message)


def test_the_stream_helper_assembles_the_non_streamed_message(server):
    request = {"system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    whole = create(server, **request)
    with client(server).messages.stream(
        model=server.model, max_tokens=24, **request, extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1  # streamed, not one block at the end
    assert "".join(pieces) == text_of(final) == text_of(whole)
    assert final.id.startswith("msg_")
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )


def test_create_with_stream_parses_every_event_in_anthropics_order(server):
    events = list(
        client(server).messages.create(
            model=server.model,
            max_tokens=8,
            messages=[{"role": "user", "content": "Write a long story."}],
            stream=True,
            extra_body=GREEDY,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert all(event.delta.type == "text_delta" for event in events[2:-3])
    assert events[0].message.usage.input_tokens > 0
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8


def test_raw_events_carry_event_lines_matching_their_type(server):
    body = {
        "model": server.model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
    }
    response = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60.0)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in response.text.split("\n\n") if block.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[len("data: ") :])["type"] == event_line[len("event: ") :]
    assert "[DONE]" not in response.text


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_choice_without_parallel_use_answers_with_one_tool_use_block(server, choice):
    message = create(
        server,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=choice | {"disable_parallel_tool_use": True},
    )
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER["input_schema"])
    # The chat route's forced call for the same request: the same arguments.
    named = (
        {"type": "function", "function": {"name": "get_weather"}} if choice["type"] == "tool" else "required"
    )
    expected = chat(
        server,
        [{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=24,
        tools=[CHAT_WEATHER],
        tool_choice=named,
        parallel_tool_calls=False,
    )
    (call,) = expected.choices[0].message.tool_calls
    assert block.input == json.loads(call.function.arguments)
    assert message.usage.input_tokens == expected.usage.prompt_tokens


def test_a_forced_tool_choice_with_parallel_use_answers_with_the_chat_routes_calls(server):
    """Anthropic's default, as OpenAI's: an answer may hold several calls (greedy SmolLM2 repeats
    a named forced call once it may), each its own tool_use block, as the chat route's calls."""
    message = create(
        server,
        max_tokens=100,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    expected = chat(
        server,
        [{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=100,
        tools=[CHAT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = expected.choices[0].message.tool_calls
    assert len(calls) >= 2  # what makes this test tell the two settings apart
    assert [(block.type, block.name, block.input) for block in message.content] == [
        ("tool_use", call.function.name, json.loads(call.function.arguments)) for call in calls
    ]


def test_a_streamed_tool_use_assembles_to_the_non_streamed_input(server):
    request = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    }
    whole = create(server, **request)
    with client(server).messages.stream(
        model=server.model, max_tokens=24, **request, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's own event for an input_json_delta
    (block,) = final.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", whole.content[0].input)
    assert final.stop_reason == "tool_use"


def test_a_tool_result_round_trip_equals_the_chat_routes_answer(server):
    call_input = {"city": "Paris"}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": call_input},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "content": [{"type": "text", "text": "Sunny, 24 C"}],
                },
                {"type": "text", "text": "Answer in one sentence."},
            ],
        },
    ]
    message = create(server, messages=messages, tools=[WEATHER])
    expected = chat(
        server,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": "toolu_01",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(call_input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_01", "content": "Sunny, 24 C"},
            {"role": "user", "content": "Answer in one sentence."},
        ],
        max_tokens=24,
        tools=[CHAT_WEATHER],
    )
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert text_of(message) == (expected.choices[0].message.content or "")
    # The tool's answer is in the prompt: without it the prompt is shorter.
    shorter = client(server).messages.count_tokens(
        model=server.model,
        messages=messages[:2] + [{"role": "user", "content": "Answer in one sentence."}],
        tools=[WEATHER],
    )
    assert shorter.input_tokens < message.usage.input_tokens


def test_count_tokens_counts_the_input_tokens_the_message_reports(server):
    request = {"system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}], "tools": [WEATHER]}
    counted = client(server).messages.count_tokens(model=server.model, **request)
    assert counted.input_tokens == create(server, **request).usage.input_tokens


def test_tool_choice_none_hides_the_tools_from_the_prompt(server):
    asked = [{"role": "user", "content": QUESTION}]
    none = create(server, messages=asked, tools=[WEATHER], tool_choice={"type": "none"})
    without = create(server, messages=asked)
    assert none.usage.input_tokens == without.usage.input_tokens
    assert text_of(none) == text_of(without)


def test_metadata_and_cache_control_are_accepted_and_change_nothing(server):
    plain = create(server, messages=[{"role": "user", "content": QUESTION}])
    hinted = create(
        server,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}}],
            }
        ],
        metadata={"user_id": "u-1"},
    )
    assert text_of(hinted) == text_of(plain)
    assert hinted.usage == plain.usage


REFUSALS = [
    # (what, request fields over a valid one, the name the message must carry)
    ("container", {"container": "container_1"}, "container"),
    ("mcp servers", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    (
        "document block",
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "document",
    ),
    (
        "thinking on a model that does not think",
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
        "thinking",
    ),
    ("adaptive thinking", {"thinking": {"type": "adaptive"}}, "thinking.type"),
    (
        "budget at max_tokens",
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024},
        "budget_tokens",
    ),
    ("temperature above 1", {"temperature": 1.5}, "temperature"),
    ("unknown field", {"max_token": 5}, "max_token"),
    ("tool choice without a name", {"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
    (
        "tool choice naming no tool",
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
        "tool_choice",
    ),
    ("empty messages", {"messages": []}, "messages"),
    (
        "image in a tool result",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {"type": "base64", "media_type": "image/png", "data": ""},
                                }
                            ],
                        }
                    ],
                }
            ]
        },
        "tool_result",
    ),
    (
        "tool_use in a user message",
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}
            ]
        },
        "tool_use",
    ),
    ("output_config", {"output_config": {"effort": "low"}}, "output_config"),
    (
        "a final assistant message (prefill)",
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
        "prefill",
    ),
    ("empty content blocks", {"messages": [{"role": "user", "content": []}]}, "messages.0: content"),
    (
        "input_schema not an object schema",
        {"tools": [{"name": "a", "input_schema": {"type": "string"}}]},
        "input_schema",
    ),
    ("tool names twice", {"tools": [WEATHER, WEATHER]}, "twice"),
    (
        # The grammar of a forced call cannot hold this keyword: named as the Messages request has it.
        "forced tool with a schema keyword no grammar holds",
        {
            "tools": [{"name": "a", "input_schema": {"type": "object", "patternProperties": {"^x": {}}}}],
            "tool_choice": {"type": "tool", "name": "a"},
        },
        "tools.0.input_schema: JSON Schema keyword 'patternProperties'",
    ),
    (
        "an image for a model without a vision tower",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                        }
                    ],
                }
            ]
        },
        "image",
    ),
]


@pytest.mark.parametrize("fields, name", [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_what_the_server_does_not_do_is_a_400_naming_it(server, fields, name):
    # extra_body's fields go into the JSON body over the ones given as arguments.
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(server).messages.create(
            model=server.model, max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body=fields
        )
    error = raised.value.body
    assert raised.value.status_code == 400
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert name in error["error"]["message"], error


def test_max_tokens_is_required_as_anthropic_requires(server):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60.0)
    assert response.status_code == 400
    assert "max_tokens" in response.json()["error"]["message"]


def test_an_unknown_model_is_not_found_in_anthropics_shape(server):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client(server).messages.create(
            model="claude-not-here", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert raised.value.body["error"]["type"] == "not_found_error"
    assert "claude-not-here" in raised.value.body["error"]["message"]


def test_a_body_that_is_not_json_is_a_400_in_anthropics_shape(server):
    response = httpx.post(
        server.base_url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_over_the_context_is_a_400_naming_max_tokens(server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=100_000)
    assert "max_tokens" in raised.value.body["error"]["message"]


def test_a_body_over_the_byte_limit_is_413_in_anthropics_shape(small_limits_server):
    body = {
        "model": small_limits_server.model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x" * 3000}],
    }
    with pytest.raises(anthropic.APIStatusError) as raised:
        client(small_limits_server).messages.create(**body)
    assert raised.value.status_code == 413
    assert raised.value.body["error"]["type"] == "request_too_large"


def test_a_client_that_hangs_up_before_its_message_stops_its_request(server):
    wait_until(lambda: engine_idle(server), what="an idle engine before the test")
    disconnects, aborts = counters(server)
    body = {
        "model": server.model,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
    }
    # A raw socket, so the test decides exactly when the client goes away.
    payload = json.dumps(body).encode()
    raw = (
        "POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(raw)
        wait_until(lambda: server.engine.stats().num_running == 1, what="the request running")
    wait_until(lambda: engine_idle(server), what="the request stopped after the disconnect")
    expected = (disconnects + 1, aborts + 1)
    wait_until(lambda: counters(server) == expected, timeout_s=5.0, what=f"counters {expected}")


def test_a_streaming_client_that_hangs_up_stops_its_request(server):
    wait_until(lambda: engine_idle(server), what="an idle engine before the test")
    disconnects, aborts = counters(server)
    body = {
        "model": server.model,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.base_url, timeout=60.0) as http,
        http.stream("POST", "/v1/messages", json=body) as response,
    ):
        deltas = (line for line in response.iter_lines() if line == "event: content_block_delta")
        next(deltas), next(deltas)  # generating
        assert server.engine.stats().num_running == 1
    wait_until(lambda: engine_idle(server), what="the request stopped after the disconnect")
    # Stopped by the hang-up, not by its own end: counted as a disconnect and an abort.
    expected = (disconnects + 1, aborts + 1)
    wait_until(lambda: counters(server) == expected, timeout_s=5.0, what=f"counters {expected}")
    steps_at_idle = server.engine.stats().num_steps
    time.sleep(0.3)
    assert server.engine.stats().num_steps == steps_at_idle


# Thinking: a tiny Qwen 3 checkpoint whose greedy answer is set by construction (a think block,
# then content; test_app_chat_tools builds it), with a context that holds Anthropic's smallest
# thinking budget (1024 tokens, below max_tokens). Its answer reads only the last token's
# embedding (attention and MLP outputs are zeroed), so a longer context changes nothing else.


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    import torch

    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.load import load_model
    from infer.models.random_checkpoint import make_random_checkpoint
    from infer.server.serve import BackgroundServer

    from .test_app_chat_tools import THINKING_ANSWER, _make_greedy_answer

    folder = make_random_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("qwen3"), dtype=torch.float32)
    _make_greedy_answer(folder, "\n", THINKING_ANSWER)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    loaded = load_model(folder, dtype=torch.float32, device="cpu")
    engine = Engine(EngineConfig(model=str(folder), max_seq_len=1200), loaded_model=loaded)
    background = BackgroundServer(engine, served_model_name="qwen3-tiny", log_level="warning")
    yield background
    background.stop()


THINKING_ON = {"type": "enabled", "budget_tokens": 1024}


def qwen3_message(background, **request) -> anthropic.types.Message:
    qwen3 = anthropic.Anthropic(base_url=background.base_url, api_key="unused", max_retries=0)
    request = {
        "model": "qwen3-tiny",
        "max_tokens": 1025,
        "messages": [{"role": "user", "content": QUESTION}],
        **request,
    }
    return qwen3.messages.create(**request, extra_body=GREEDY)


def test_thinking_enabled_gives_a_thinking_block_before_the_text(qwen3_server):
    message = qwen3_message(qwen3_server, thinking=THINKING_ON)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == ("Hm", "OK")
    assert message.stop_reason == "end_turn"


def test_thinking_left_out_or_disabled_is_off_as_anthropics_default(qwen3_server):
    for thinking in ({}, {"thinking": {"type": "disabled"}}):
        message = qwen3_message(qwen3_server, **thinking)
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == "<think>Hm</think>OK"  # the model's text, unsplit


def test_streamed_thinking_arrives_as_thinking_deltas_then_text(qwen3_server):
    qwen3 = anthropic.Anthropic(base_url=qwen3_server.base_url, api_key="unused", max_retries=0)
    with qwen3.messages.stream(
        model="qwen3-tiny",
        max_tokens=1025,
        messages=[{"role": "user", "content": QUESTION}],
        thinking=THINKING_ON,
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and kinds.index("thinking") < kinds.index("text")
    assert [
        (block.type, getattr(block, "thinking", None) or getattr(block, "text", None))
        for block in final.content
    ] == [
        ("thinking", "Hm"),
        ("text", "OK"),
    ]


# Images: the random gemma3-vision-tiny checkpoint of test_app_images (on the CPU). An image block
# with a base64 source is the chat route's image_url part with a data: URL: the same prompt, the
# same greedy answer.


def test_a_base64_image_block_answers_as_the_chat_routes_image_part(tmp_path_factory):
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.load import load_model
    from infer.models.random_checkpoint import make_random_checkpoint
    from infer.server.serve import BackgroundServer

    from .test_app_images import PICTURE, VLM, data_url, image_part

    checkpoint = make_random_checkpoint(VLM, tmp_path_factory.mktemp(VLM), dtype=torch.float32)
    engine = Engine(
        EngineConfig(model=str(checkpoint), max_seq_len=256), load_model(checkpoint, dtype=torch.float32)
    )
    background = BackgroundServer(engine, served_model_name=VLM, log_level="warning")
    try:
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PICTURE).decode()}
        blocks = [{"type": "text", "text": "What is it?"}, {"type": "image", "source": source}]
        vlm = anthropic.Anthropic(base_url=background.base_url, api_key="unused", max_retries=0)
        message = vlm.messages.create(
            model=VLM, max_tokens=8, messages=[{"role": "user", "content": blocks}], extra_body=GREEDY
        )
        parts = [{"type": "text", "text": "What is it?"}, image_part(data_url(PICTURE))]
        openai_client = openai.OpenAI(api_key="unused", base_url=f"{background.base_url}/v1", max_retries=0)
        expected = openai_client.chat.completions.create(
            model=VLM, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
        )
        assert message.usage.input_tokens == expected.usage.prompt_tokens
        assert text_of(message) == expected.choices[0].message.content
        # The image is in the prompt: without it, fewer tokens.
        assert vlm.messages.count_tokens(
            model=VLM, messages=[{"role": "user", "content": blocks[:1]}]
        ).input_tokens < (message.usage.input_tokens)
    finally:
        background.stop()
