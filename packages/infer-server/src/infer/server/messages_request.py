"""The request body of Anthropic's Messages API (POST /v1/messages), validated by pydantic, and its
translation into the chat route's ChatCompletionRequest (what vLLM's Anthropic entrypoint does),
so the same conversation gives the same prompt and the same answer on both routes.

The rules of infer.server.schemas hold here too: an unknown field is a 400 naming it, a wrong
type is not coerced, null for an optional field means its default, and every error names its
field (`messages.0.content.1.input`). What Anthropic's API has and the translation means:
- `system` (a string or text blocks) is the chat's system message; text blocks of one message
  are joined by newlines, as the chat route joins text parts.
- A user message's `tool_result` blocks become tool messages (their `content`, a string or text
  blocks, is the tool's answer; `is_error` is accepted and the text is all the model sees, as
  vLLM has it); its `text` and `image` blocks (base64 or URL sources, read as the chat route
  reads image_url parts) the user message. An assistant message's `tool_use` blocks become its
  tool calls (`input` as the JSON arguments); its `thinking` and `redacted_thinking` blocks,
  which clients pass back, are dropped, as the chat templates drop earlier reasoning.
- `tools` are custom tools (`name`, `description`, `input_schema`); `tool_choice` `auto`, `any`
  (some call: the chat route's "required"), `tool` with a `name` (that call), `none`;
  `disable_parallel_tool_use: true` is the chat route's `parallel_tool_calls: false` (at most one
  call; Anthropic's default, as OpenAI's, lets an answer hold several).
- `thinking` `{"type": "enabled", "budget_tokens": N}` turns on the thinking of a model whose
  template has the switch (Qwen 3; refused by name for others), `disabled` or left out turns it
  off, as Anthropic's default is no thinking. The budget is checked as Anthropic checks it
  (>= 1024, below max_tokens) and is not a separate limit: max_tokens bounds thinking and text
  together.
- `temperature` in [0, 1] (Anthropic's range), `top_p`, `top_k`, `stop_sequences`, `stream`.
- Accepted and ignored, since they do not change the output: `metadata`, `cache_control` (at the
  top and on any block), `service_tier`, `inference_geo`, `speed`, `diagnostics`,
  `user_profile_id`, `workspace_id`, a text block's `citations`, a tool's `strict` (as the chat
  route takes it).
- Refused by name (400, `unsupported_value`) unless null: `container`, `mcp_servers`,
  `context_management`, `output_config`; server tools (a tool `type` other than `custom`), block
  types other than text, image, tool_use, tool_result, thinking and redacted_thinking, images
  inside a tool_result, `thinking` `adaptive`, and a final assistant message (Anthropic's
  prefill, which the answer would continue: the chat templates here open a new turn instead).
"""

import json
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from infer.server import errors
from infer.server.errors import ApiError
from infer.server.messages_blocks import (
    ImageBlock,
    MessageParam,
    MessagesTool,
    MessagesToolChoice,
    TextBlock,
    ThinkingConfig,
    ToolResultBlock,
    ToolUseBlock,
)
from infer.server.schemas import (
    EMPTY_INPUT,
    INVALID_VALUE,
    MAX_STOP_STRINGS,
    UNSUPPORTED_VALUE,
    ChatCompletionRequest,
    _Strict,
)

# Fields of Anthropic's request that ask for what this server does not do: accepted only at null.
NOT_DONE_HERE = ("container", "mcp_servers", "context_management", "output_config")


class _MessagesPrompt(_Strict):
    """The fields that make the prompt: POST /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Accepted and ignored: they do not change the output.
    metadata: dict[str, Any] | None = None
    cache_control: Any = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Only null (NOT_DONE_HERE).
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    output_config: Any = None

    @field_validator("messages")
    @classmethod
    def _messages_non_empty(cls, value: list[MessageParam]) -> list[MessageParam]:
        if not value:
            raise PydanticCustomError(EMPTY_INPUT, "messages must hold at least one message")
        if value[-1].role == "assistant":
            # Anthropic continues a final assistant message (a prefill); the chat templates here
            # close every message and open a new turn, which would answer something else.
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                "a final assistant message (a prefill the answer continues) is not supported; end "
                "the conversation with a user message",
            )
        return value

    @field_validator("tools")
    @classmethod
    def _tool_names_unique(cls, value: list[MessagesTool] | None) -> list[MessagesTool] | None:
        names = [tool.name for tool in value or []]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise PydanticCustomError(
                    INVALID_VALUE,
                    "tool {index}: name {name!r} appears twice in tools; names must be unique",
                    {"index": index, "name": name},
                )
        return value

    @field_validator(*NOT_DONE_HERE)
    @classmethod
    def _null_only(cls, value: Any, info) -> Any:
        if value is not None:
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                f"{info.field_name} is not supported by this server; leave it out",
            )
        return value

    def chat_fields(self, thinking_switch: bool) -> dict[str, Any]:
        """The ChatCompletionRequest fields of this prompt (JSON values). `thinking_switch`: the
        served model's template has `enable_thinking`; ApiError 400 for thinking on without it."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            fields["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            )
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        thinking = self.thinking is not None and self.thinking.enabled
        if thinking_switch:
            fields["chat_template_kwargs"] = {"enable_thinking": thinking}
        elif thinking:
            raise ApiError(
                400,
                "thinking: this model does not think (its chat template has no thinking switch); "
                'leave thinking out or send {"type": "disabled"}',
                errors.INVALID_REQUEST,
                "thinking",
                UNSUPPORTED_VALUE,
            )
        return fields

    def _chat_messages(self) -> list[dict[str, Any]]:
        chat: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _joined(self.system)
            chat.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                chat.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                chat += _user_messages(message.content)
            else:
                chat.append(_assistant_message(message.content))
        return chat


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _user_messages(blocks: list) -> list[dict[str, Any]]:
    """A user turn as chat messages: each tool_result a tool message, the text and images between
    them a user message, in the order of the blocks."""
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if parts:
                messages.append({"role": "user", "content": parts})
                parts = []
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": block.url}})
        else:
            parts.append({"type": "text", "text": block.text})
    if parts:
        messages.append({"role": "user", "content": parts})
    return messages


def _assistant_message(blocks: list) -> dict[str, Any]:
    texts = [block for block in blocks if isinstance(block, TextBlock)]
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input)},
        }
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": _joined(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


class MessagesRequest(_MessagesPrompt):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # Off when left out (or 0), as the chat route's.
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences_non_empty(cls, value: list[str]) -> list[str]:
        if any(text == "" for text in value):
            raise PydanticCustomError(INVALID_VALUE, "every stop sequence must be non-empty")
        return value

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        # As Anthropic: the thinking budget is part of max_tokens.
        if (
            self.thinking is not None
            and self.thinking.enabled
            and self.thinking.budget_tokens >= self.max_tokens
        ):
            raise ApiError(
                400,
                f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be below max_tokens "
                f"({self.max_tokens})",
                errors.INVALID_REQUEST,
                "thinking.budget_tokens",
                INVALID_VALUE,
            )
        return self

    def to_chat_request(self, thinking_switch: bool) -> ChatCompletionRequest:
        """The same request for the chat route's pipeline (infer.server.chat_run)."""
        fields = self.chat_fields(thinking_switch) | {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "stream": self.stream,
        }
        return _chat_request(fields)


class CountTokensRequest(_MessagesPrompt):
    """POST /v1/messages/count_tokens: the prompt of a Messages request, nothing generated."""

    def to_chat_request(self, thinking_switch: bool) -> ChatCompletionRequest:
        return _chat_request(self.chat_fields(thinking_switch))


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps(fields))
    except ValidationError as error:
        # What the Messages schema let through and the chat schema does not (a tool result
        # without an id, say): named as the chat route names it, since the paths differ.
        translated = errors.from_validation_error(error)
        raise ApiError(
            400,
            f"messages: the conversation cannot be run as a chat: {translated.message}",
            errors.INVALID_REQUEST,
            "messages",
            translated.code,
        ) from None
