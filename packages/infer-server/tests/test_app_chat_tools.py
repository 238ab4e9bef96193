"""Tools and thinking on /v1/chat/completions, on a real server through the real `openai` client.

Oracles: our chat template rendered and tokenized by hand (usage.prompt_tokens counts exactly
those tokens), and the OpenAI wire format (SSE events read raw with httpx). SmolLM2 (ChatML, the
Hermes tool format) serves the tool tests; a tiny Qwen 3 checkpoint whose greedy answer is set by
construction (a think block, then content) the thinking tests.
"""

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
BOOKING_TOOL = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a restaurant table",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string", "minLength": 1, "maxLength": 30},
                "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "seating": {"enum": ["inside", "terrace"]},
            },
            "required": ["restaurant", "guests", "time"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _prompt_tokens(loaded, messages, **render_kwargs) -> int:
    prompt = loaded.chat_template.render(messages, add_generation_prompt=True, **render_kwargs)
    return len(loaded.tokenizer.encode(prompt, add_special_tokens=False))


def _assert_one_call(choice, tools: list[dict]) -> dict:
    """The answer is one parsed call to one of `tools`, its arguments valid for that tool."""
    assert choice.finish_reason == "tool_calls", f"no call parsed from content {choice.message.content!r}"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert call.function.name in parameters
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters[call.function.name])
    return arguments


# A forced call (named or "required") is the server writing the call's opening after the prompt
# and a grammar holding the rest to the function's parameters (infer.server.tool_grammar): with
# parallel_tool_calls false the answer is always one call to a tool of the request, its arguments
# validating (by `jsonschema`, never the grammar) against that tool's schema, whatever the model
# would have written alone. (Several calls, the default: test_app_grammar.)


def test_named_tool_choice_answers_with_a_call_to_that_function(server):
    answer = server.openai_client().chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=NAMED,
        temperature=0,
        parallel_tool_calls=False,
    )
    _assert_one_call(answer.choices[0], [WEATHER_TOOL])


def test_a_tool_call_answer_message_carries_refusal_null(server):
    """OpenAI's schema requires `refusal` in every message, a tool call's too; read raw, as the
    `openai` client fills a missing key with None itself."""
    body = {
        "model": server.model,
        "messages": QUESTION,
        "tools": [WEATHER_TOOL],
        "tool_choice": NAMED,
        "temperature": 0,
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None, choice["message"]


def test_a_tool_loop_sends_the_sdk_dump_of_the_call_back_and_gets_an_answer(server, smollm2_loaded):
    """The round trip every agent does: a forced call, its message resent as the SDK dumps it
    (`message.model_dump()`: refusal, audio, function_call null, the call's id), the tool's
    result, and a second request that is answered and counts exactly our rendering of it."""
    client = server.openai_client()
    first = client.chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=NAMED,
        temperature=0,
        parallel_tool_calls=False,
    )
    _assert_one_call(first.choices[0], [WEATHER_TOOL])
    dumped = first.choices[0].message.model_dump()
    assert dumped["refusal"] is None and dumped["tool_calls"][0]["id"]
    call_id = dumped["tool_calls"][0]["id"]
    messages = [*QUESTION, dumped, {"role": "tool", "tool_call_id": call_id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=8
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens == _prompt_tokens(smollm2_loaded, messages, tools=[WEATHER_TOOL])


def test_required_tool_choice_answers_with_a_call_to_one_of_the_tools(server):
    answer = server.openai_client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Call get_weather for Paris."}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )
    _assert_one_call(answer.choices[0], [WEATHER_TOOL, TIME_TOOL])


def test_required_call_prompt_is_the_rendering_plus_the_opening_of_any_call(server, smollm2_loaded):
    answer = server.openai_client().chat.completions.create(
        model=server.model, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=1
    )
    prompt = smollm2_loaded.chat_template.render(QUESTION, tools=[WEATHER_TOOL])
    expected = smollm2_loaded.tokenizer.encode(prompt + '<tool_call>\n{"name": "', add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(expected)


def test_a_required_call_is_a_call_where_the_model_alone_names_no_tool(server):
    # Unconstrained, SmolLM2 writes `{"name": "Paris"` after this opening (measured before the
    # grammar): no tool of the request's, so no call. Held to the grammar it calls get_weather.
    answer = server.openai_client().chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=32,
    )
    _assert_one_call(answer.choices[0], [WEATHER_TOOL])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "book_table"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_arguments_hold_to_a_rich_schema_streamed_or_not(server, tool_choice, stream):
    body = {
        "messages": [{"role": "user", "content": "Book a table for two at Luigi's tonight at 8."}],
        "tools": [WEATHER_TOOL, BOOKING_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "temperature": 0.8,
        "seed": 11,
        "max_tokens": 120,
    }
    if not stream:
        answer = server.openai_client().chat.completions.create(model=server.model, **body)
        arguments = _assert_one_call(answer.choices[0], [WEATHER_TOOL, BOOKING_TOOL])
    else:
        events = _stream_events(server, {**body, "stream": True})
        chunks = [json.loads(payload) for payload in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        (call,) = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
        assert call["function"]["name"] in ("get_weather", "book_table")
        arguments = json.loads(call["function"]["arguments"])
        tool = WEATHER_TOOL if call["function"]["name"] == "get_weather" else BOOKING_TOOL
        jsonschema.validate(arguments, tool["function"]["parameters"])
    assert isinstance(arguments, dict)


NOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "save_note",
        "description": "Save a note",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
# Greedy, SmolLM2 copies the tag into the note: `{"text": "</tool_call>"}`.
NOTE_WITH_THE_CLOSING_TAG = [{"role": "user", "content": 'Save a note with the text "</tool_call>".'}]


def _streamed_call(server, body: dict) -> dict:
    """The function of a streamed answer's one call, which ends with finish_reason tool_calls and
    has no content."""
    events = _stream_events(server, {**body, "stream": True})
    chunks = [json.loads(payload) for payload in events[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    content = "".join(delta.get("content") or "" for delta in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls", f"no call parsed from {content!r}"
    assert content == ""
    (call,) = [call for delta in deltas for call in delta.get("tool_calls", [])]
    return call["function"]


# The grammar lets a string hold any text, the call's closing tag `</tool_call>` included; the
# call still ends at the tag after the arguments, and is read back whole.
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "save_note"}}],
    ids=["required", "named"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_whose_string_holds_the_closing_tag_is_one_call(server, tool_choice, stream):
    body = {
        "messages": NOTE_WITH_THE_CLOSING_TAG,
        "tools": [NOTE_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
    }
    if not stream:
        answer = server.openai_client().chat.completions.create(model=server.model, temperature=0, **body)
        arguments = _assert_one_call(answer.choices[0], [NOTE_TOOL])
    else:
        function = _streamed_call(server, {**body, "temperature": 0})
        assert function["name"] == "save_note"
        arguments = json.loads(function["arguments"])
        jsonschema.validate(arguments, NOTE_TOOL["function"]["parameters"])
    assert arguments == {"text": "</tool_call>"}


def test_a_sampled_forced_call_that_writes_the_closing_tag_in_a_string_is_one_call(server):
    # At seed 32 and the default temperature SmolLM2 opens the city's string with `}}</tool_call>`
    # (as if closing the call), then goes on and closes the string later.
    answer = server.openai_client().chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        seed=32,
        parallel_tool_calls=False,
    )
    arguments = _assert_one_call(answer.choices[0], [WEATHER_TOOL])
    assert "</tool_call>" in arguments["city"]  # the case it is meant to be (else pick another seed)


def test_a_forced_call_to_a_tool_whose_schema_cannot_be_enforced_is_a_400_naming_it(server):
    tool = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        },
    }
    client = server.openai_client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model, messages=QUESTION, tools=[tool], tool_choice="required", max_tokens=4
        )
    assert caught.value.body["param"] == "tools.0.function.parameters.properties.tags.uniqueItems"
    assert "uniqueItems" in caught.value.message
    # Not forced, nothing is enforced: the same tool is fine.
    answer = client.chat.completions.create(model=server.model, messages=QUESTION, tools=[tool], max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_forced_call_prompt_is_the_rendering_plus_the_calls_opening(server, smollm2_loaded):
    answer = server.openai_client().chat.completions.create(
        model=server.model, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=NAMED, max_tokens=1
    )
    prompt = smollm2_loaded.chat_template.render(QUESTION, tools=[WEATHER_TOOL])
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    expected = smollm2_loaded.tokenizer.encode(prompt + opening, add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(expected)


def test_a_tool_result_conversation_is_answered_and_counted_as_our_rendering(server, smollm2_loaded):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    answer = server.openai_client().chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == _prompt_tokens(smollm2_loaded, messages, tools=[WEATHER_TOOL])


def test_tool_choice_none_renders_no_tools(server, smollm2_loaded):
    answer = server.openai_client().chat.completions.create(
        model=server.model, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=1
    )
    assert answer.usage.prompt_tokens == _prompt_tokens(smollm2_loaded, QUESTION)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tool_choice": NAMED}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools.1.function.name"),
    ],
    ids=[
        "unknown-function",
        "named-without-tools",
        "parameters-string-schema",
        "parameters-list",
        "duplicate",
    ],
)
def test_inconsistent_tools_are_a_400_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.openai_client().chat.completions.create(model=server.model, messages=QUESTION, **extra)
    assert caught.value.status_code == 400
    assert caught.value.body["param"].startswith(param)
    assert caught.value.body["type"] == "invalid_request_error"


def _stream_events(server, body: dict) -> list[str]:
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json={"model": server.model, **body}, timeout=120.0
    ) as response:
        assert response.status_code == 200
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_streaming_with_tools_ends_with_one_finish_chunk_then_done_and_matches_the_body(server):
    body = {
        "messages": QUESTION,
        "tools": [WEATHER_TOOL],
        "tool_choice": NAMED,
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    events = _stream_events(server, {**body, "stream": True})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(payload) for payload in events[:-1]]
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
    assert [reason for reason in finishes if reason is not None] == [finishes[-1]]
    streamed_calls = [call for chunk in chunks for call in chunk["choices"][0]["delta"].get("tool_calls", [])]
    streamed_content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)

    whole = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"model": server.model, **body}, timeout=120.0
    ).json()["choices"][0]
    assert finishes[-1] == whole["finish_reason"] == "tool_calls"
    assert [call["function"]["name"] for call in whole["message"]["tool_calls"]] == ["get_weather"]
    assert streamed_content == (whole["message"]["content"] or "")
    whole_calls = whole["message"].get("tool_calls", [])
    assert [call["function"] for call in streamed_calls] == [call["function"] for call in whole_calls]
    assert [call["index"] for call in streamed_calls] == list(range(len(whole_calls)))


# -- thinking, on a tiny Qwen 3 whose greedy answer is known -----------------------------------

# What the model answers after the generation prompt (whose last token is "\n"), token by token:
# Qwen 3's thinking form, without the newlines, which the script cannot repeat (see below).
THINKING_ANSWER = ["<think>", "H", "m", "</think>", "O", "K", "<|im_end|>"]


def _make_greedy_answer(folder, after: str, answer: list[str]) -> None:
    """Rewrites the random tiny Qwen 3 in `folder` so that, greedily, the token `after` is followed
    by the tokens of `answer`, each by the next, whatever came before (so the tokens must differ).

    Every layer's o_proj and down_proj are zeroed, so the last hidden state is the last token's
    embedding and the logits are RMSNorm(e_t) . e_j (tied embeddings). The chain's k-th token
    gets embedding s * 4**k * (u_k + u_k+1) / sqrt(2), u the unit vectors: its successor scores
    sqrt(d) * s * 4**(k+1) / 2, twice what the token itself scores, and every other token of the
    chain 0; the untouched random tokens score about N(0, 4**2), far below at s = 4.
    """
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoded = [tokenizer.encode(text, add_special_tokens=False).ids for text in [after, *answer]]
    chain = [token_id for (token_id,) in encoded]  # one token each
    assert len(set(chain)) == len(chain), chain
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
    weights["model.norm.weight"].fill_(1.0)
    embedding = weights["model.embed_tokens.weight"]
    for k, token_id in enumerate(chain):
        embedding[token_id] = 0.0
        embedding[token_id, k] = embedding[token_id, k + 1] = 4.0 * 4.0**k / 2**0.5
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    import torch

    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.load import load_model
    from infer.models.random_checkpoint import make_random_checkpoint
    from infer.server.serve import BackgroundServer

    folder = make_random_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("qwen3"), dtype=torch.float32)
    _make_greedy_answer(folder, "\n", THINKING_ANSWER)
    loaded = load_model(folder, dtype=torch.float32, device="cpu")
    engine = Engine(EngineConfig(model=str(folder), max_seq_len=256), loaded_model=loaded)
    background = BackgroundServer(engine, served_model_name="qwen3-tiny", log_level="warning")
    yield background, loaded
    background.stop()


def _qwen3_chat(background, *, thinking: bool, **options):
    client = openai.OpenAI(api_key="unused", base_url=f"{background.base_url}/v1", max_retries=0)
    return client.chat.completions.create(
        model="qwen3-tiny",
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        **options,
    )


def test_thinking_on_splits_the_generated_think_block_into_reasoning_content(qwen3_server):
    background, _ = qwen3_server
    choice = _qwen3_chat(background, thinking=True).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.model_extra.get("reasoning_content") == "Hm"
    assert choice.message.content == "OK"


def test_thinking_off_leaves_the_answer_whole_in_content(qwen3_server):
    background, _ = qwen3_server
    message = _qwen3_chat(background, thinking=False).choices[0].message
    assert message.model_extra.get("reasoning_content") is None
    assert message.content == "<think>Hm</think>OK"


def test_streamed_thinking_sends_reasoning_deltas_before_content_deltas(qwen3_server):
    background, _ = qwen3_server
    kinds, texts = [], {"reasoning_content": "", "content": ""}
    for chunk in _qwen3_chat(background, thinking=True, stream=True):
        delta = chunk.choices[0].delta
        for kind in texts:
            piece = delta.content if kind == "content" else (delta.model_extra or {}).get(kind)
            if piece:
                kinds.append(kind)
                texts[kind] += piece
    assert texts == {"reasoning_content": "Hm", "content": "OK"}
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index)


def test_thinking_off_adds_the_empty_think_block_to_the_prompt(qwen3_server):
    background, loaded = qwen3_server
    usage = {
        thinking: _qwen3_chat(background, thinking=thinking).usage.prompt_tokens for thinking in (True, False)
    }
    empty_block = loaded.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert usage[False] - usage[True] == len(empty_block)
    assert usage[True] == _prompt_tokens(loaded, QUESTION)


@pytest.mark.parametrize(
    ("effort", "thinking"),
    [("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True)],
)
def test_reasoning_effort_switches_thinking_as_enable_thinking_does(qwen3_server, effort, thinking):
    """OpenAI's reasoning_effort through the official client: "none" and "minimal" are Qwen 3's
    enable_thinking false, the others true. Oracle: the answer and prompt of the request that
    sets enable_thinking itself (the thinking tests above pin both)."""
    background, _ = qwen3_server
    client = openai.OpenAI(api_key="unused", base_url=f"{background.base_url}/v1", max_retries=0)
    answer = client.chat.completions.create(
        model="qwen3-tiny", messages=QUESTION, max_tokens=16, temperature=0, reasoning_effort=effort
    )
    expected = _qwen3_chat(background, thinking=thinking)
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    message, expected_message = answer.choices[0].message, expected.choices[0].message
    assert message.content == expected_message.content == ("OK" if thinking else "<think>Hm</think>OK")
    assert message.model_extra.get("reasoning_content") == ("Hm" if thinking else None)


def test_an_explicit_enable_thinking_wins_over_reasoning_effort(qwen3_server):
    background, _ = qwen3_server
    answer = _qwen3_chat(background, thinking=False, reasoning_effort="high")
    assert answer.choices[0].message.content == "<think>Hm</think>OK"
    assert answer.usage.prompt_tokens == _qwen3_chat(background, thinking=False).usage.prompt_tokens


def test_reasoning_effort_on_a_model_without_thinking_changes_nothing(server):
    client = server.openai_client()
    settings = dict(model=server.model, messages=QUESTION, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**settings)
    for effort in ("none", "high"):
        answer = client.chat.completions.create(**settings, reasoning_effort=effort)
        assert answer.choices[0].message.content == plain.choices[0].message.content
        assert answer.usage == plain.usage
