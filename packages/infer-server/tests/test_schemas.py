"""What the request models accept and how they normalize it; rejections and their statuses are in
test_errors.py."""

import pytest
from pydantic import ValidationError

from infer.engine import SamplingParams
from infer.server.schemas import ChatCompletionRequest, CompletionRequest


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("prompt", "kept"),
    [
        ("Hello", "Hello"),
        ("", ""),  # the tokenizer may still add BOS; the server judges the token count
        ([1, 2, 3], [1, 2, 3]),
        (["Hello"], "Hello"),  # a batch of one is its prompt
        ([[1, 2]], [1, 2]),
    ],
)
def test_prompt_forms(prompt, kept):
    assert completion(prompt=prompt).prompt == kept


def test_completion_defaults_follow_openai():
    request = completion()
    assert (request.max_tokens, request.temperature, request.top_p, request.stream) == (16, 1.0, 1.0, False)


def test_stop_accepts_one_string_a_list_or_null():
    assert completion(stop="\n").stop == ["\n"]
    assert completion(stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]
    assert completion(stop=None).stop == []


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_follows_vllm(top_k):
    # -1 and 0 both mean "off"; the engine receives 0 for both.
    assert completion(top_k=top_k).to_sampling_kwargs()["top_k"] == max(top_k, 0)


@pytest.mark.parametrize(
    ("field", "neutral"),
    [("n", 1), ("echo", False), ("best_of", 1), ("suffix", None), ("presence_penalty", 0)]
    + [("frequency_penalty", 0.0), ("logit_bias", {}), ("user", "alice")],
)
def test_unimplemented_openai_fields_pass_at_their_neutral_value(field, neutral):
    completion(**{field: neutral})


@pytest.mark.parametrize(
    ("field", "neutral"),
    [(field, value) for field, values in ChatCompletionRequest.NEUTRAL_VALUES.items() for value in values],
)
def test_chat_fields_we_do_not_implement_pass_at_their_neutral_value(field, neutral):
    # The official client sends these at null when a caller passes None; the output is the same.
    chat(**{field: neutral})


def test_sampling_kwargs_build_the_engine_sampling_params():
    request = completion(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        max_tokens=32,
        stop="END",
        stop_token_ids=[2],
        seed=7,
        ignore_eos=True,
    )
    params = SamplingParams(**request.to_sampling_kwargs())
    assert params == SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        max_new_tokens=32,
        stop=["END"],
        stop_token_ids=[2],
        seed=7,
        ignore_eos=True,
    )


def test_every_valid_range_edge_is_accepted_by_the_engine_too():
    # The schema must never accept what SamplingParams would then reject (a 500 instead of a 400).
    for fields in [
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-6},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"max_tokens": 1},
    ]:
        SamplingParams(**completion(**fields).to_sampling_kwargs())


def test_chat_token_limit_prefers_max_completion_tokens_then_max_tokens_then_the_servers_default():
    assert chat(max_completion_tokens=5).to_sampling_kwargs(max_new_tokens_default=100)["max_new_tokens"] == 5
    assert chat(max_tokens=6).to_sampling_kwargs(max_new_tokens_default=100)["max_new_tokens"] == 6
    assert chat(max_tokens=7, max_completion_tokens=7).to_sampling_kwargs()["max_new_tokens"] == 7
    assert chat().to_sampling_kwargs(max_new_tokens_default=100)["max_new_tokens"] == 100
    assert "max_new_tokens" not in chat().to_sampling_kwargs()  # SamplingParams' default applies
    SamplingParams(**chat().to_sampling_kwargs())


def test_text_parts_are_joined_by_newlines():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.messages[0].content == "one\ntwo"


def test_a_tool_conversation_validates_and_reaches_the_template_as_plain_dicts():
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    request = chat(messages=messages, tools=tools, tool_choice="auto", parallel_tool_calls=True)
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [tool_call]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(
    "tool_choice",
    [None, "none", "auto", "required", {"type": "function", "function": {"name": "weather"}}],
)
def test_every_openai_tool_choice_is_accepted(tool_choice):
    # Whether it fits the tools is checked later, with them (infer.server.chat_tools).
    request = chat(tool_choice=tool_choice)
    if isinstance(tool_choice, dict):
        assert request.tool_choice.function.name == "weather"
    else:
        assert request.tool_choice == tool_choice


@pytest.mark.parametrize(
    "tool_choice",
    ["maybe", {"type": "function"}, {"type": "function", "function": {"name": 3}}, {"type": "tool"}],
)
def test_a_malformed_tool_choice_is_refused_naming_the_shapes_allowed(tool_choice):
    with pytest.raises(ValidationError, match='tool_choice must be "none", "auto", "required"'):
        chat(tool_choice=tool_choice)


def test_tool_parameters_reach_the_tool_rules_unchanged():
    # Not a JSON Schema object: the schema keeps it, infer.server.chat_tools answers 400.
    tools = [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}]
    assert chat(tools=tools).tools[0].function.parameters == ["city"]


def test_chat_template_kwargs_pass_through():
    assert chat(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {
        "enable_thinking": False
    }
    assert chat(chat_template_kwargs=None).chat_template_kwargs == {}


def test_response_format_text_is_the_neutral_value():
    chat(response_format={"type": "text"})


def test_include_usage_only_when_streaming_and_asked():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage
    assert not chat(stream=True).include_usage


# -- OpenAI-valid input (issue 14) ---------------------------------------------------------------

OPTIONAL_NULLS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stream",
    "seed",
    "ignore_eos",
]


@pytest.mark.parametrize("field", OPTIONAL_NULLS)
def test_null_for_an_optional_field_means_its_default(field):
    for build in (completion, chat):
        assert getattr(build(**{field: None}), field) == getattr(build(), field)


def test_null_keeps_its_own_meaning_where_it_has_one():
    assert completion(max_tokens=None).max_tokens is None  # as many as the context leaves


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_any_int64_seed_is_accepted(seed):
    assert completion(seed=seed).seed == seed


def test_a_developer_message_is_a_system_message():
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        }
    )
    assert [m["role"] for m in request.template_messages()] == ["system", "user"]


def test_an_assistant_message_as_the_sdk_dumps_it_is_accepted_and_its_echo_fields_dropped():
    dumped = {
        "role": "assistant",
        "content": "Paris.",
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": None,
        "tool_calls": None,
    }
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Capital?"}, dumped, {"role": "user", "content": "Ok"}],
        }
    )
    assert request.template_messages()[1] == {"role": "assistant", "content": "Paris."}


@pytest.mark.parametrize("field", ["audio", "function_call"])
def test_a_non_null_audio_or_function_call_is_refused_by_name(field):
    message = {"role": "assistant", "content": "x", field: {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValidationError, match=field):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})


def test_openai_metadata_fields_are_accepted_and_change_nothing():
    metadata = {
        "store": True,
        "metadata": {"team": "a"},
        "service_tier": "auto",
        "safety_identifier": "hash",
        "prompt_cache_key": "k",
        "user": "u",
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    plain = {"stream": True, "stream_options": {"include_usage": True}}
    for build in (completion, chat):
        assert build(**metadata).to_sampling_kwargs() == build(**plain).to_sampling_kwargs()


@pytest.mark.parametrize(
    ("effort", "kwargs", "thinking"),
    [
        ("none", {}, False),
        ("minimal", {}, False),
        ("low", {}, True),
        ("high", {}, True),
        ("high", {"enable_thinking": False}, False),  # the explicit template variable wins
        (None, {}, None),
    ],
)
def test_reasoning_effort_maps_onto_enable_thinking(effort, kwargs, thinking):
    request = chat(reasoning_effort=effort, chat_template_kwargs=kwargs)
    assert request.template_kwargs().get("enable_thinking") == thinking
