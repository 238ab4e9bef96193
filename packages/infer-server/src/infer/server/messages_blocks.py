"""The parts of an Anthropic Messages API request (infer.server.messages_request): content blocks,
messages, custom tools, tool_choice and the thinking switch, validated by pydantic as the chat
route's bodies are (infer.server.schemas: unknown fields refused, no coercion, every error naming
its field). What the server accepts of each, and what it refuses by name, is said where the
request is (messages_request's docstring).
"""

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from infer.server.schemas import EMPTY_INPUT, INVALID_VALUE, UNSUPPORTED_VALUE, _Strict

# Anthropic's own floor for a thinking budget.
MIN_THINKING_BUDGET_TOKENS = 1024
MESSAGE_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Any = None
    citations: Any = None


class Base64ImageSource(_Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlImageSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]
    cache_control: Any = None

    @property
    def url(self) -> str:
        """The image as the chat route's image_url part takes it."""
        if isinstance(self.source, UrlImageSource):
            return self.source.url
        return f"data:{self.source.media_type};base64,{self.source.data}"


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_blocks_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, block in enumerate(value):
                block_type = block.get("type") if isinstance(block, dict) else None
                if block_type != "text":
                    raise PydanticCustomError(
                        UNSUPPORTED_VALUE,
                        f"block {index} of a tool_result's content has type {block_type!r}; only text "
                        "blocks (or a string) are supported there",
                    )
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: Any = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: Any = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, value: Any) -> Any:
        # One message naming the type, rather than pydantic's tag error.
        if isinstance(value, list):
            for index, block in enumerate(value):
                block_type = block.get("type") if isinstance(block, dict) else None
                if block_type not in MESSAGE_BLOCK_TYPES:
                    raise PydanticCustomError(
                        UNSUPPORTED_VALUE,
                        f"content block {index} has type {block_type!r}; this server takes "
                        f"{', '.join(MESSAGE_BLOCK_TYPES)} blocks",
                    )
        return value

    @model_validator(mode="after")
    def _blocks_of_the_role(self):
        if isinstance(self.content, str):
            return self
        if not self.content:
            raise PydanticCustomError(EMPTY_INPUT, "content must hold at least one block (or be a string)")
        only = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant"}
        only |= {"tool_result": "user", "image": "user"}
        for index, block in enumerate(self.content):
            role = only.get(block.type)
            if role is not None and role != self.role:
                raise PydanticCustomError(
                    INVALID_VALUE,
                    f"content block {index}: {block.type} blocks belong in {role} messages, not "
                    f"{self.role} messages",
                )
        return self


class MessagesTool(_Strict):
    # First, so that a server tool (no input_schema) is refused for its type.
    type: str | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None
    strict: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        # As Anthropic (and OpenAI for parameters): the input is a JSON object.
        if value.get("type") != "object":
            raise PydanticCustomError(
                INVALID_VALUE,
                'input_schema must be a JSON Schema object ({{"type": "object", "properties": ...}}), '
                "got type {type!r}",
                {"type": value.get("type")},
            )
        if not isinstance(value.get("properties", {}), dict):
            raise PydanticCustomError(INVALID_VALUE, "properties of input_schema must be an object")
        return value

    @field_validator("type")
    @classmethod
    def _custom_tools_only(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                "server tools ({type}) are not supported: this server runs no tools; send custom "
                "tools (name, description, input_schema) and run them yourself",
                {"type": value},
            )
        return value


class MessagesToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    # true: at most one tool call in the answer (the chat route's parallel_tool_calls false).
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool_only(self):
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError(
                INVALID_VALUE, 'tool_choice {"type": "tool"} needs a name, and only it takes one'
            )
        return self


class ThinkingConfig(_Strict):
    type: str
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET_TOKENS)

    @field_validator("type")
    @classmethod
    def _enabled_or_disabled(cls, value: str) -> str:
        if value not in ("enabled", "disabled"):
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                'thinking {type!r} is not supported; send {{"type": "enabled", "budget_tokens": N}} '
                'or {{"type": "disabled"}}',
                {"type": value},
            )
        return value

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise PydanticCustomError(INVALID_VALUE, 'thinking "enabled" needs budget_tokens')
        return self

    @property
    def enabled(self) -> bool:
        return self.type == "enabled"
