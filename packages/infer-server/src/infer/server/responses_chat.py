"""A /v1/responses body read as a chat request (`infer.server.schemas.ChatCompletionRequest`),
which the chat route's pipeline (infer.server.chat_run) then runs.

- `instructions` is a system message first (not carried over by `previous_response_id`, as
  OpenAI has it); `input` as a string is one user message; input items are read in order:
  a message item (roles user, system, developer, assistant; content a string or `input_text`,
  `output_text` and, from the user, `input_image` parts with an image URL) is a chat message;
  `function_call` items are the assistant's `tool_calls` (joined to the assistant message just
  before them); a `function_call_output` is a `tool` message answering its call_id; a
  `reasoning` item is skipped, as the chat route skips earlier turns' reasoning.
- `tools` of type `function` in the Responses' flat shape (name, description, parameters,
  strict on the tool itself) are chat function tools; `tool_choice` {"type": "function",
  "name": ...} is chat's named choice; `max_output_tokens` is `max_completion_tokens`;
  `reasoning.effort` is `reasoning_effort` ("xhigh" and "max" as "high": on a thinking model
  any effort but "none" and "minimal" turns thinking on); `text.format` is `response_format`.

Every error names the Responses' field (`input.2.call_id`, `tools.0.parameters`,
`text.format`), never the chat field it was read into (`chat_param` translates those). Built-in
tools and tool choices, file and audio inputs, images by file id and item references are 400s
naming the field.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from infer.server import errors
from infer.server.errors import ApiError, from_validation_error
from infer.server.responses_request import ResponsesRequest
from infer.server.schemas import ChatCompletionRequest, _Strict

# -- items --------------------------------------------------------------------------------------


class _MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Any]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # OpenAI's commentary / final answer mark: not the conversation


class _FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: None = None
    caller: Any = None


class _FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Any]
    id: str | None = None
    status: str | None = None


class _ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


class _FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None
    defer_loading: Literal[False] | None = None
    allowed_callers: list[Literal["direct"]] | None = None
    output_schema: None = None


_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
    "reasoning": _ReasoningItem,
}


@dataclass(frozen=True)
class ChatReading:
    """A body read as a chat request, and where each of its messages came from (`input.3`,
    `instructions`, `previous_response_id`), so that an error the chat side raises about
    `messages.N` names the Responses' field."""

    request: ChatCompletionRequest
    message_sources: list[str]

    def responses_error(self, error: ApiError) -> ApiError:
        return chat_param(error, self.message_sources)


def chat_request(body: ResponsesRequest, earlier_items: list[Any]) -> ChatReading:
    """The chat request `body` runs as: `earlier_items` (a stored conversation that
    previous_response_id continues) then body's own input. ApiError 400 naming the Responses'
    field."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []

    def add(item: Any, where: str, source: str) -> None:
        before = len(messages)
        _add_item(messages, item, where)
        sources.extend([source] * (len(messages) - before))

    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        sources.append("instructions")
    for index, item in enumerate(earlier_items):
        add(item, f"previous_response_id (its item {index})", "previous_response_id")
    for index, item in enumerate(body.input_items()):
        where = f"input.{index}" if isinstance(body.input, list) else "input"
        add(item, where, where)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "tools": [_chat_tool(tool, f"tools.{index}") for index, tool in enumerate(body.tools or [])] or None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.reasoning is not None and body.reasoning.effort is not None:
        effort = body.reasoning.effort
        fields["reasoning_effort"] = "high" if effort in ("xhigh", "max") else effort
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = body.text.format.response_format()
    try:
        return ChatReading(ChatCompletionRequest.model_validate(fields), sources)
    except ValidationError as error:
        raise chat_param(from_validation_error(error), sources) from None


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """Appends what input item `item` (at `where`) says to the chat `messages`."""
    if not isinstance(item, dict):
        raise _bad(where, f"an input item is an object, got {type(item).__name__}")
    item_type = item.get("type", "message")
    model = _ITEM_MODELS.get(item_type)
    if model is None:
        raise _bad(
            f"{where}.type",
            f"input items of type {item_type!r} are not supported here; send message, function_call, "
            "function_call_output or reasoning items",
            "unsupported_value",
        )
    parsed = _validated(model, item, where)
    if isinstance(parsed, _MessageItem):
        messages.append({"role": parsed.role, "content": _chat_content(parsed, where)})
    elif isinstance(parsed, _FunctionCallItem):
        call = {
            "id": parsed.call_id,
            "type": "function",
            "function": {"name": parsed.name, "arguments": parsed.arguments},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif isinstance(parsed, _FunctionCallOutputItem):
        output = parsed.output
        if isinstance(output, list):
            output = "\n".join(_text_parts(output, f"{where}.output", ("input_text",)))
        messages.append({"role": "tool", "tool_call_id": parsed.call_id, "content": output})
    # A reasoning item is skipped: chat templates drop earlier turns' reasoning.


def _chat_content(message: _MessageItem, where: str) -> str | list[dict[str, Any]]:
    if isinstance(message.content, str):
        return message.content
    text_type = "output_text" if message.role == "assistant" else "input_text"
    parts = []
    for index, part in enumerate(message.content):
        field = f"{where}.content.{index}"
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type == "input_image" and message.role == "user":
            parts.append(_image_part(part, field))
        elif part_type == "refusal" and message.role == "assistant":
            continue  # a refusal the SDK dumps back is not conversation, as on chat
        else:
            parts.append({"type": "text", "text": _text_of(part, field, (text_type,))})
    return parts


def _text_parts(parts: list[Any], where: str, types: tuple[str, ...]) -> list[str]:
    return [_text_of(part, f"{where}.{index}", types) for index, part in enumerate(parts)]


def _text_of(part: Any, where: str, types: tuple[str, ...]) -> str:
    """The text of a text part whose type is one of `types`."""
    part_type = part.get("type") if isinstance(part, dict) else None
    if part_type not in types:
        raise _bad(
            f"{where}.type",
            f"content part type {part_type!r} is not supported here; send {' or '.join(types)} parts "
            "(a user message may also hold input_image parts)",
            "unsupported_value",
        )
    text = part.get("text")
    if not isinstance(text, str) or set(part) - {"type", "text", "annotations", "logprobs"}:
        raise _bad(where, f'a {part_type} part is {{"type": "{part_type}", "text": <string>}}')
    return text


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    extra = set(part) - {"type", "image_url", "file_id", "detail"}
    if extra:
        raise _bad(f"{where}.{sorted(extra)[0]}", "unknown field of an input_image part; remove it")
    if part.get("file_id") is not None:
        raise _bad(
            f"{where}.file_id",
            "uploaded files are not kept here; send the image as image_url",
            "unsupported_value",
        )
    url = part.get("image_url")
    if not isinstance(url, str):
        raise _bad(f"{where}.image_url", "an input_image part needs image_url, a data: or http(s) URL")
    # `detail` is accepted and ignored, as on chat: the model's processor sizes every image itself.
    return {"type": "image_url", "image_url": {"url": url}}


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    tool_type = tool.get("type") if isinstance(tool, dict) else None
    if tool_type != "function":
        raise _bad(
            f"{where}.type",
            f"tools of type {tool_type!r} are not supported here (no built-in tools: web search, file "
            "search, computer use, code interpreter, image generation, MCP, ...); send function tools",
            "unsupported_value",
        )
    parsed = _validated(_FunctionTool, tool, where)
    function = {"name": parsed.name, "description": parsed.description, "parameters": parsed.parameters}
    function = {key: value for key, value in function.items() if value is not None}
    if parsed.strict is not None:
        function["strict"] = parsed.strict
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if set(choice) != {"type", "name"} or not isinstance(choice["name"], str):
            raise _bad("tool_choice", 'a named tool_choice is {"type": "function", "name": <string>}')
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise _bad(
            "tool_choice",
            f'tool_choice of type {choice["type"]!r} is not supported here; send "none", "auto", '
            '"required" or {"type": "function", "name": ...}',
            "unsupported_value",
        )
    raise _bad(
        "tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
    )


def _validated(model: type[BaseModel], value: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as error:
        api_error = from_validation_error(error)
        inner = api_error.param
        param = f"{where}.{inner}" if inner else where
        message = api_error.message.replace(inner, param, 1) if inner else f"{where}: {api_error.message}"
        raise ApiError(api_error.status, message, api_error.type, param, api_error.code) from None


# Chat fields -> the Responses' fields they were read from, for errors the chat side raises
# (`messages.N` by the message's source, in `chat_param`).
_CHAT_PARAMS = [
    (re.compile(r"^tools\.(\d+)\.function(\.[\w.]*)?$"), r"tools.\1\2"),
    (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name"),
    (re.compile(r"^response_format(\.[\w.]*)?$"), "text.format"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
]
_MESSAGE_PARAM = re.compile(r"^messages(?:\.(\d+)(\..*)?)?$")


def chat_param(error: ApiError, message_sources: Sequence[str] = ()) -> ApiError:
    """`error` (raised reading the body as a chat) naming the Responses' field instead of the chat
    one: `messages.N...` is the item message N came from (`messages.2.content.1.image_url.url`:
    `input.1.content.1.image_url`), `messages` alone is `input`, `tools.0.function.parameters` is
    `tools.0.parameters`, ..."""
    if error.param is None:
        return error
    param = None
    message = _MESSAGE_PARAM.match(error.param)
    if message is not None:
        index, rest = message.groups()
        if index is not None and int(index) < len(message_sources):
            source = message_sources[int(index)]
            # A user item's parts are its chat message's parts, in order; an input_image's
            # image_url is the URL itself.
            rest = rest or ""
            if rest.endswith(".image_url.url"):
                rest = rest.removesuffix(".url")
            param = source + rest if source.startswith("input.") else source
        else:
            param = "input"
    else:
        for pattern, replacement in _CHAT_PARAMS:
            if pattern.match(error.param):
                param = pattern.sub(replacement, error.param)
                break
    if param is None:
        return error
    return ApiError(error.status, error.message.replace(error.param, param), error.type, param, error.code)


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", errors.INVALID_REQUEST, param, code)
