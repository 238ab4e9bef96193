"""Our non-streamed response bodies, read by the OpenAI client as its own types."""

import httpx

from infer.server import responses


def answering_json(body):
    return lambda request: httpx.Response(200, json=body)


def test_completion_response(openai_client_answering):
    usage = responses.usage(5, 2)
    body = responses.completion(
        "cmpl-1", 1_700_000_000, "smollm2", " Paris.", "stop", usage, token_ids=[9, 10]
    )
    completion = openai_client_answering(answering_json(body)).completions.create(model="smollm2", prompt="x")
    assert completion.object == "text_completion"
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (" Paris.", "stop")
    assert completion.choices[0].model_extra["token_ids"] == [9, 10]
    assert (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
        completion.usage.total_tokens,
    ) == (
        5,
        2,
        7,
    )


def test_chat_completion_response_with_a_tool_call(openai_client_answering):
    tool_call = responses.tool_call("call_1", "weather", '{"city":"Paris"}')
    usage = responses.usage(20, 9, cached_prompt_tokens=0)
    body = responses.chat_completion(
        "chatcmpl-1", 0, "qwen3", None, "tool_calls", usage, tool_calls=[tool_call]
    )
    chat = openai_client_answering(answering_json(body)).chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "Weather?"}]
    )
    message = chat.choices[0].message
    assert (message.role, message.content, chat.choices[0].finish_reason) == ("assistant", None, "tool_calls")
    assert message.tool_calls[0].function.name == "weather"
    assert chat.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion_response_with_reasoning_content(openai_client_answering):
    body = responses.chat_completion(
        "chatcmpl-1", 0, "qwen3", "Four.", "stop", responses.usage(5, 9), reasoning_content="2 + 2 is 4."
    )
    chat = openai_client_answering(answering_json(body)).chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "2 + 2?"}]
    )
    message = chat.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Four.", "2 + 2 is 4.")
    without = responses.chat_completion("chatcmpl-1", 0, "m", "Four.", "stop", responses.usage(5, 1))
    assert "reasoning_content" not in without["choices"][0]["message"]


def test_tool_call_ids_are_unique_openai_style():
    ids = {responses.new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(call_id.startswith("call_") and len(call_id) == 29 for call_id in ids)


def test_model_list_carries_the_context_length(openai_client_answering):
    body = responses.model_list([("smollm2-135m-instruct", 8192), ("gemma-3-270m", 32768)], created=0)
    models = list(openai_client_answering(answering_json(body)).models.list())
    assert [(model.id, model.model_extra["max_model_len"]) for model in models] == [
        ("smollm2-135m-instruct", 8192),
        ("gemma-3-270m", 32768),
    ]
    assert {model.object for model in models} == {"model"}


def test_request_ids_are_unique_and_prefixed():
    ids = {responses.new_request_id("chatcmpl") for _ in range(100)}
    assert len(ids) == 100
    assert all(request_id.startswith("chatcmpl-") for request_id in ids)
