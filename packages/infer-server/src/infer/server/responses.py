"""Response bodies of the OpenAI-compatible API, built as plain dicts.

Plain dicts, not pydantic models: the server sends them as they are, the SSE encoder
(`infer.server.sse`) derives its byte templates from the chunk builders here, and the tests check
each shape against the `openai` client's own response types. Key order is OpenAI's.
"""

import uuid
from typing import Any

# `finish_reason` values: "stop" (EOS or a stop string/token), "length" (token limit or context
# full), "tool_calls". Never "abort", which is not OpenAI's: a request the server cancels gets a
# 503 (a body) or an error event (a stream), and a client that went away reads nothing.


def new_request_id(prefix: str) -> str:
    """An OpenAI-style id: `cmpl-...` for completions, `chatcmpl-...` for chat."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_prompt_tokens: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_prompt_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_prompt_tokens}
    return body


def completion(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
    token_ids: list[int] | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole /v1/completions response with one choice (`merge_choices` joins several);
    `logprobs` as `infer.server.logprobs` renders them, when the client asked."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_completion_choice(text, finish_reason, token_ids, index, logprobs)],
        "usage": usage,
    }


def chat_completion(
    id: str,
    created: int,
    model: str,
    content: str | None,
    finish_reason: str,
    usage: dict[str, Any],
    tool_calls: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None,
    reasoning_content: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole /v1/chat/completions response with one choice (`merge_choices` joins several).
    `tool_calls` as `tool_call` builds them; `reasoning_content` (vLLM's field for a thinking
    model's reasoning) only when given; `logprobs` as `infer.server.logprobs` renders them."""
    # `refusal` is required by OpenAI's schema (null: the model did not refuse).
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids  # vLLM's extension field
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def merge_choices(bodies: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """One response holding the choices of single-choice responses of one request (n > 1),
    in order, with the usage of them all."""
    return {**bodies[0], "choices": [body["choices"][0] for body in bodies], "usage": usage}


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id, `call_` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of `message.tool_calls`; `arguments` is the JSON object as a string."""
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_delta(index: int, id: str, name: str, arguments: str) -> dict[str, Any]:
    """A streamed delta carrying one whole tool call (its `index` counts the answer's calls)."""
    return {"tool_calls": [{"index": index, **tool_call(id, name, arguments)}]}


def completion_chunk(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    include_usage: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed /v1/completions chunk of choice `index`. With `include_usage` every chunk but
    the last carries `"usage": null`, as OpenAI does when the client asked for
    `stream_options.include_usage`."""
    chunk: dict[str, Any] = {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_completion_choice(text, finish_reason, token_ids, index, logprobs)],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(
    id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    include_usage: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed /v1/chat/completions chunk of choice `index`; `delta` is e.g. {"content": "Hi"},
    {"reasoning_content": "..."}, a `tool_call_delta`, {"role": "assistant", "content": ""} (the
    first chunk) or {} (the finishing one)."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(object: str, id: str, created: int, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream whose client asked for usage: no choices, only `usage`.
    `object` is "text_completion" or "chat.completion.chunk"."""
    return {"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage}


def model_list(models: list[tuple], created: int, owned_by: str = "infer") -> dict[str, Any]:
    """GET /v1/models from (model id, max_model_len), (model id, max_model_len, state) or (model
    id, max_model_len, state, pooling) tuples."""
    return {
        "object": "list",
        "data": [
            model(
                *entry[:2],
                created,
                owned_by,
                state=entry[2] if len(entry) > 2 else None,
                pooling=entry[3] if len(entry) > 3 else None,
            )
            for entry in models
        ],
    }


def model(
    model_id: str,
    max_model_len: int | None,
    created: int,
    owned_by: str = "infer",
    state: str | None = None,
    pooling: str | None = None,
) -> dict[str, Any]:
    """One model object (GET /v1/models/{model}); `max_model_len` is vLLM's field for the
    context length (null for a model not loaded yet), `state` ours: whether it is resident
    (loaded, loading, unloading, unloaded, failed; infer.server.served_models), as LM Studio's
    and Ollama's model lists tell it; `pooling` ours: how /v1/embeddings pools its hidden states
    ("last" or "mean"). OpenAI's four fields come first, unchanged."""
    body = {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "max_model_len": max_model_len,
    }
    if state is not None:
        body["state"] = state
    if pooling is not None:
        body["pooling"] = pooling
    return body


def _completion_choice(
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None,
    index: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice
