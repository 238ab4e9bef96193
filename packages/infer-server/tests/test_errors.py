"""Which status, param and code each invalid request gets, and that OpenAI's client reads our error
bodies as OpenAI errors."""

# The case table reads best one case per line.
# ruff: noqa: E501

import json

import httpx
import openai
import pytest

from infer.server import errors
from infer.server.errors import ApiError, parse_request
from infer.server.schemas import ChatCompletionRequest, CompletionRequest

COMPLETION = {"model": "m", "prompt": "Hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
USER_HI = {"role": "user", "content": "Hi"}
DROP = object()  # in a case's fields: remove this field from the base body

# (case id, request model, fields over the base body, status, param, code, text the message must hold)
CASES = [
    ("prompt-batch-too-long", CompletionRequest, {"prompt": ["a"] * 129}, 400, "prompt", "invalid_value", "at most 128 prompts"),
    ("prompt-batch-with-an-empty-one", CompletionRequest, {"prompt": [[1], []]}, 400, "prompt", "empty_input", "must not be empty"),
    ("prompt-empty-ids", CompletionRequest, {"prompt": []}, 400, "prompt", "empty_input", "must not be empty"),
    ("prompt-empty-batch-of-one", CompletionRequest, {"prompt": [[]]}, 400, "prompt", "empty_input", "must not be empty"),
    ("prompt-number", CompletionRequest, {"prompt": 5}, 400, "prompt", "invalid_value", "a string, a list of token ids"),
    ("prompt-negative-id", CompletionRequest, {"prompt": [1, -2]}, 400, "prompt", "invalid_value", "token ids"),
    ("prompt-bool-id", CompletionRequest, {"prompt": [True]}, 400, "prompt", "invalid_value", "token ids"),
    ("prompt-missing", CompletionRequest, {"prompt": DROP}, 400, "prompt", "missing_required_parameter", "missing required field 'prompt'"),
    ("model-missing", CompletionRequest, {"model": DROP}, 400, "model", "missing_required_parameter", "'model'"),
    ("temperature-high", CompletionRequest, {"temperature": 2.5}, 400, "temperature", "invalid_value", "2.5"),
    ("temperature-negative", CompletionRequest, {"temperature": -0.1}, 400, "temperature", "invalid_value", "-0.1"),
    ("temperature-text", CompletionRequest, {"temperature": "hot"}, 400, "temperature", "invalid_value", "'hot'"),
    ("top-p-zero", CompletionRequest, {"top_p": 0}, 400, "top_p", "invalid_value", "greater than 0"),
    ("top-p-high", CompletionRequest, {"top_p": 1.5}, 400, "top_p", "invalid_value", "1.5"),
    ("top-k-below-minus-one", CompletionRequest, {"top_k": -2}, 400, "top_k", "invalid_value", "-1"),
    ("min-p-high", CompletionRequest, {"min_p": 1.5}, 400, "min_p", "invalid_value", "1.5"),
    ("repetition-penalty-infinite", CompletionRequest, {"repetition_penalty": float("inf")}, 400, "repetition_penalty", "invalid_value", "finite"),
    ("temperature-nan", CompletionRequest, {"temperature": float("nan")}, 400, "temperature", "invalid_value", "finite"),
    ("repetition-penalty-zero", CompletionRequest, {"repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value", "greater than 0"),
    ("stop-five", CompletionRequest, {"stop": list("abcde")}, 400, "stop", "invalid_value", "at most 4"),
    ("stop-empty-string", CompletionRequest, {"stop": [""]}, 400, "stop", "invalid_value", "non-empty"),
    ("stop-number", CompletionRequest, {"stop": ["a", 1]}, 400, "stop.1", "invalid_value", "string"),
    ("seed-below-int64", CompletionRequest, {"seed": -(2**63) - 1}, 400, "seed", "invalid_value", str(-(2**63) - 1)),
    ("seed-too-big", CompletionRequest, {"seed": 2**63}, 400, "seed", "invalid_value", str(2**63)),
    ("n-zero", CompletionRequest, {"n": 0}, 400, "n", "invalid_value", "greater than or equal to 1"),
    ("n-above-openai-limit", CompletionRequest, {"n": 129}, 400, "n", "invalid_value", "less than or equal to 128"),
    ("n-true", CompletionRequest, {"n": True}, 400, "n", "invalid_value", "True"),
    ("echo-not-a-bool", CompletionRequest, {"echo": "yes"}, 400, "echo", "invalid_value", "boolean"),
    ("logprobs-above-5", CompletionRequest, {"logprobs": 6}, 400, "logprobs", "invalid_value", "less than or equal to 5"),
    ("logprobs-with-echo-streamed", CompletionRequest, {"logprobs": 1, "echo": True, "stream": True}, 400, "logprobs", "unsupported_value", "echo"),
    ("max-tokens-zero-without-echo", CompletionRequest, {"max_tokens": 0}, 400, "max_tokens", "invalid_value", "without echo"),
    ("prompt-logprobs-above-20", CompletionRequest, {"prompt_logprobs": 21}, 400, "prompt_logprobs", "invalid_value", "less than or equal to 20"),
    ("prompt-logprobs-streamed", ChatCompletionRequest, {"prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs", "unsupported_value", "not streamed"),
    ("best-of", CompletionRequest, {"best_of": 2}, 400, "best_of", "unsupported_value", "best_of"),
    ("suffix", CompletionRequest, {"suffix": "}"}, 400, "suffix", "unsupported_value", "suffix"),
    ("presence-penalty-high", CompletionRequest, {"presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value", "2.5"),
    ("frequency-penalty-low", CompletionRequest, {"frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value", "-3"),
    ("logit-bias-high", CompletionRequest, {"logit_bias": {"1": 101}}, 400, "logit_bias", "invalid_value", "[-100, 100]"),
    ("logit-bias-key", CompletionRequest, {"logit_bias": {"cat": 5}}, 400, "logit_bias", "invalid_value", "token ids"),
    ("unknown-field", CompletionRequest, {"max_token": 5}, 400, "max_token", "unknown_parameter", "unknown field 'max_token'"),
    ("stream-options-without-stream", CompletionRequest, {"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value", "only allowed when stream is true"),
    ("stream-options-unknown", CompletionRequest, {"stream": True, "stream_options": {"x": 1}}, 400, "stream_options.x", "unknown_parameter", "'stream_options.x'"),
    ("messages-empty", ChatCompletionRequest, {"messages": []}, 400, "messages", "empty_input", "at least one message"),
    ("messages-missing", ChatCompletionRequest, {"messages": DROP}, 400, "messages", "missing_required_parameter", "'messages'"),
    ("role-unknown", ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "invalid_value", "'robot'"),
    ("content-missing", ChatCompletionRequest, {"messages": [{"role": "user"}]}, 400, "messages.0", "invalid_value", "needs content"),
    ("content-audio", ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400, "messages.0.content", "unsupported_value", "only {\"type\": \"text\""),
    ("content-image-without-url", ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages.0.content", "invalid_value", "content part 0: image_url.url: Field required"),
    ("content-image-url-a-string", ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}]}, 400, "messages.0.content", "invalid_value", "content part 0: image_url"),
    ("content-image-detail-unknown", ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}]}]}, 400, "messages.0.content", "invalid_value", "'auto', 'low' or 'high'"),
    ("content-image-in-system", ChatCompletionRequest, {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, USER_HI]}, 400, "messages.0", "invalid_value", "only user messages may hold image_url parts"),
    ("prompt-image-part", CompletionRequest, {"prompt": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, 400, "prompt", "unsupported_value", "/v1/completions takes no images"),
    ("content-part-malformed", ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content", "invalid_value", "part 0 must be exactly"),
    ("message-unknown-field", ChatCompletionRequest, {"messages": [{**USER_HI, "foo": 1}]}, 400, "messages.0.foo", "unknown_parameter", "'messages.0.foo'"),
    ("tool-without-call-id", ChatCompletionRequest, {"messages": [USER_HI, {"role": "tool", "content": "18 C"}]}, 400, "messages.1", "invalid_value", "tool_call_id"),
    ("tool-calls-on-user", ChatCompletionRequest, {"messages": [{**USER_HI, "tool_calls": []}]}, 400, "messages.0", "invalid_value", "only assistant messages"),
    ("tool-choice-named-no-name", ChatCompletionRequest, {"tool_choice": {"type": "function", "function": {}}}, 400, "tool_choice", "invalid_value", "{\"type\": \"function\", \"function\": {\"name\": ...}}"),
    ("tool-choice-unknown", ChatCompletionRequest, {"tool_choice": "maybe"}, 400, "tool_choice", "invalid_value", "must be \"none\""),
    ("tool-missing-name", ChatCompletionRequest, {"tools": [{"type": "function", "function": {}}]}, 400, "tools.0.function.name", "missing_required_parameter", "'tools.0.function.name'"),
    ("response-format-unique-items", ChatCompletionRequest, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format", "unsupported_value", "'uniqueItems'"),
    ("response-format-lookahead", CompletionRequest, {"response_format": {"type": "regex", "pattern": "a(?=b)"}}, 400, "response_format", "invalid_value", "cannot be enforced"),
    ("response-format-unknown-type", ChatCompletionRequest, {"response_format": {"type": "xml"}}, 400, "response_format", "invalid_value", "must be one of text, json_object, json_schema, regex"),
    ("response-format-no-schema", ChatCompletionRequest, {"response_format": {"type": "json_schema"}}, 400, "response_format", "invalid_value", "needs a schema"),
    ("chat-audio", ChatCompletionRequest, {"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio", "unsupported_value", "leave audio out or send null"),
    ("chat-modalities-audio", ChatCompletionRequest, {"modalities": ["text", "audio"]}, 400, "modalities", "unsupported_value", 'send null or ["text"]'),
    ("chat-functions", ChatCompletionRequest, {"functions": [{"name": "f", "parameters": {}}]}, 400, "functions", "unsupported_value", "functions"),
    ("chat-function-call", ChatCompletionRequest, {"function_call": "auto"}, 400, "function_call", "unsupported_value", "function_call"),
    ("chat-prediction", ChatCompletionRequest, {"prediction": {"type": "content", "content": "x"}}, 400, "prediction", "unsupported_value", "prediction"),
    ("chat-verbosity", ChatCompletionRequest, {"verbosity": "low"}, 400, "verbosity", "unsupported_value", "verbosity"),
    ("chat-moderation", ChatCompletionRequest, {"moderation": {"enabled": True}}, 400, "moderation", "unsupported_value", "moderation"),
    ("chat-prompt-cache-options", ChatCompletionRequest, {"prompt_cache_options": {"x": 1}}, 400, "prompt_cache_options", "unsupported_value", "prompt_cache_options"),
    ("chat-web-search", ChatCompletionRequest, {"web_search_options": {}}, 400, "web_search_options", "unsupported_value", "web_search_options"),
    ("token-limits-disagree", ChatCompletionRequest, {"max_tokens": 5, "max_completion_tokens": 6}, 400, "max_completion_tokens", "invalid_value", "disagrees with max_tokens"),
    ("chat-logprobs-not-bool", ChatCompletionRequest, {"logprobs": 1}, 400, "logprobs", "invalid_value", "boolean"),
    ("chat-top-logprobs-alone", ChatCompletionRequest, {"top_logprobs": 3}, 400, "top_logprobs", "invalid_value", "needs logprobs: true"),
    ("chat-top-logprobs-above-20", ChatCompletionRequest, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value", "less than or equal to 20"),
    ("chat-n-zero", ChatCompletionRequest, {"n": 0}, 400, "n", "invalid_value", "greater than or equal to 1"),
]  # fmt: skip


def body_of(model, fields) -> str:
    body = dict(COMPLETION if model is CompletionRequest else CHAT)
    for key, value in fields.items():
        if value is DROP:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body)


@pytest.mark.parametrize(
    ("model", "fields", "status", "param", "code", "says"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_invalid_request_gets_its_status_param_and_code(model, fields, status, param, code, says):
    with pytest.raises(ApiError) as caught:
        parse_request(model, body_of(model, fields))
    error = caught.value
    assert (error.status, error.param, error.code, error.type) == (
        status,
        param,
        code,
        "invalid_request_error",
    )
    assert says in error.message


@pytest.mark.parametrize("raw", ["{", '{"model": "m",}', "", "not json"])
def test_malformed_json_is_400(raw):
    with pytest.raises(ApiError) as caught:
        parse_request(ChatCompletionRequest, raw)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_json", None)
    assert caught.value.message.startswith("request body is not valid JSON")


@pytest.mark.parametrize("raw", ["[]", '"text"', "3", "null"])
def test_a_body_that_is_not_an_object_is_400(raw):
    with pytest.raises(ApiError) as caught:
        parse_request(CompletionRequest, raw)
    assert (caught.value.status, caught.value.code) == (400, "invalid_body")


def test_the_message_counts_the_errors_it_does_not_show():
    with pytest.raises(ApiError) as caught:
        parse_request(
            CompletionRequest, '{"model": "m", "prompt": "x", "best_of": 2, "suffix": "}", "foo": 1}'
        )
    assert caught.value.message.endswith("(and 2 more errors)")


def test_long_inputs_are_shortened_in_messages():
    with pytest.raises(ApiError) as caught:
        parse_request(CompletionRequest, json.dumps({**COMPLETION, "temperature": "x" * 10_000}))
    assert len(caught.value.message) < 300


def test_body_has_openais_shape():
    error = errors.queue_full(max_waiting_requests=64)
    assert error.body() == {
        "error": {"message": error.message, "type": "server_error", "param": None, "code": "queue_full"}
    }
    assert error.status == 503


@pytest.mark.parametrize(
    ("error", "status", "exception"),
    [
        (errors.ApiError(400, "bad", param="prompt", code="invalid_value"), 400, openai.BadRequestError),
        (
            errors.ApiError(400, "unsupported", param="n", code="unsupported_value"),
            400,
            openai.BadRequestError,
        ),
        (
            errors.ApiError(413, "too large", param="prompt", code="prompt_too_large"),
            413,
            openai.APIStatusError,
        ),
        (errors.model_not_found("llama", ["smollm2"]), 404, openai.NotFoundError),
        (errors.context_length_exceeded(9000, 100, 8192), 400, openai.BadRequestError),
        (errors.queue_full(64), 503, openai.InternalServerError),
        (errors.internal_error("engine step failed"), 500, openai.InternalServerError),
    ],
    ids=["400", "400-unsupported", "413", "404-model", "400-context", "503-queue", "500"],
)
def test_openai_client_reads_our_error(openai_client_answering, error, status, exception):
    client = openai_client_answering(lambda request: httpx.Response(error.status, json=error.body()))
    with pytest.raises(exception) as caught:
        client.completions.create(model="m", prompt="Hi")
    assert caught.value.status_code == status
    assert caught.value.message == f"Error code: {status} - {error.message}"
    assert (caught.value.code, caught.value.param, caught.value.type) == (error.code, error.param, error.type)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "4"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": True}, "temperature"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(fields, param):
    """Issue 14: "4" became 4 and true became 1; a wrong type is a 400 naming the field."""
    with pytest.raises(ApiError) as caught:
        parse_request(CompletionRequest, json.dumps({**COMPLETION, **fields}))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, "invalid_value")


def test_echoed_input_in_an_error_is_cut():
    """Issue 14: a 100,000-character model name must not come back whole."""
    long_name = "m" * 100_000
    error = errors.model_not_found(long_name, ["smollm2"])
    assert len(error.message) < 300
    for fields in ({"temperature": "x" * 100_000}, {"n": "x" * 100_000}, {"y" * 100_000: 1}):
        with pytest.raises(ApiError) as caught:
            parse_request(CompletionRequest, json.dumps({**COMPLETION, **fields}))
        assert len(caught.value.message) < 600 and len(caught.value.param) < 100
