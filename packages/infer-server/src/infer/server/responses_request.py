"""POST /v1/responses bodies (OpenAI's Responses API, openai-python's response_create_params.py),
validated by pydantic as the other routes' bodies are (infer.server.schemas' rules: unknown fields
refused, nulls as defaults, each error naming its field).

`input`, `tools` and `tool_choice` are kept as sent here: infer.server.responses_chat reads them
into a chat request, naming the item or tool at fault. What would change the output and is not
done here is a 400 naming the field: `background`, `include` values, `truncation: "auto"`,
`conversation`, stored `prompt` templates, logprobs, verbosity, reasoning summaries by name.
OpenAI's bookkeeping fields are accepted (`metadata` is echoed back).
"""

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from infer.server.schemas import EMPTY_INPUT, UNSUPPORTED_VALUE, _Strict

# OpenAI's limit on metadata: 16 keys.
MAX_METADATA_KEYS = 16

# Fields OpenAI takes that would change the answer and are not done here: accepted at null only.
_NOT_DONE_HERE = {
    "conversation": "conversations are not stored here; send the items in input, or previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "context_management": "context compaction is not done here; leave context_management out",
    "moderation": "moderation is not done here; leave moderation out",
    "image": "image generation options are not supported; leave image out",
    "access_programs": "access programs are not supported; leave access_programs out",
    "background_options": "background responses are not supported; leave background_options out",
    "prompt_cache_options": "prompt cache options are not supported (the prefix cache is automatic); "
    "leave prompt_cache_options out",
}


class ResponsesStreamOptions(_Strict):
    # OpenAI pads stream events against side channels; nothing here to obfuscate: ignored.
    include_obfuscation: bool | None = None


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # "auto" lets the server choose, and no summary is what it chooses: a reasoning item holds the
    # model's own reasoning text (content), its summary stays empty. A summary asked for by
    # name would be a promise not kept.
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None  # OpenAI's older name for summary
    context: Literal["auto"] | None = None
    mode: Literal["standard"] | None = None

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _no_summaries(cls, value: Any) -> Any:
        if value in ("concise", "detailed"):
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                "reasoning summaries are not written here (a reasoning item holds the model's own "
                'reasoning text); leave it out or send "auto"',
            )
        return value


class TextFormat(_Strict):
    """text.format: OpenAI's text, json_object, and json_schema with name, schema, description and
    strict beside the type (flat, unlike chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """Chat's response_format for the same output."""
        if self.type != "json_schema":
            return {"type": self.type}
        json_schema = {"name": self.name, "schema": self.schema_, "description": self.description}
        return {
            "type": "json_schema",
            "json_schema": {key: value for key, value in json_schema.items() if value is not None},
        }


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: None = None  # GPT-5's verbosity knob: not done here, null only

    @field_validator("verbosity", mode="before")
    @classmethod
    def _verbosity_off(cls, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError(UNSUPPORTED_VALUE, "verbosity is not supported; leave it out")
        return value


class ResponsesRequest(_Strict):
    """POST /v1/responses. `input`, `tools` and `tool_choice` are kept as sent and read by
    `chat_request`, which names the item or tool at fault."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # OpenAI asks for at least 16; any positive limit means what it says here.
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    # Passed to the chat request as it is: what it means there, it means here.
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    # Counts calls to built-in tools, which this server has none of: it cannot change the answer.
    max_tool_calls: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    # Accepted and ignored, as on chat: the provider's bookkeeping, not the output.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # _NOT_DONE_HERE: null only.
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None

    @field_validator(*_NOT_DONE_HERE)
    @classmethod
    def _null_only(cls, value: Any, info) -> Any:
        if value is not None:
            raise PydanticCustomError(UNSUPPORTED_VALUE, _NOT_DONE_HERE[info.field_name])
        return value

    @field_validator("input")
    @classmethod
    def _input_non_empty(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise PydanticCustomError(EMPTY_INPUT, "input must hold at least one item")
        return value

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_auto_truncation(cls, value: Any) -> Any:
        if value == "auto":
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                'truncation "auto" (dropping early items to fit the context) is not done here; '
                'send "disabled" or leave it out (a conversation over the context is a 400)',
            )
        return value

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                f"{value[0]!r} cannot be included: this server adds nothing to its output items "
                "(no encrypted reasoning, logprobs, search results or image URLs); leave include empty",
            )
        return value

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError(
                UNSUPPORTED_VALUE,
                "background responses are not supported; leave background out and wait for the answer "
                "(or stream it)",
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise PydanticCustomError(
                UNSUPPORTED_VALUE, "logprobs are not given on /v1/responses; leave top_logprobs out or send 0"
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise PydanticCustomError(
                "invalid_value", f"metadata holds at most {MAX_METADATA_KEYS} keys, got {len(value)}"
            )
        return value

    def input_items(self) -> list[Any]:
        """`input` as items: a string is one user message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return list(self.input)
