"""Request bodies of the OpenAI-compatible API, validated by pydantic, and their sampling settings.

What is checked here is everything that can be judged from the body alone: shapes, ranges, and the
OpenAI fields this server does not implement. Anything that needs the model (does the prompt fit
the context, is `model` served here) is the server's job once it has tokenized.

Rules every request model follows (each error names its field; `infer.server.errors` turns the
pydantic error into an OpenAI error body and picks the HTTP status):

- An unknown field is rejected (400), never silently ignored: a typo such as `max_token` would
  otherwise quietly change the output.
- An OpenAI field we do not implement (completions: `best_of`, `suffix`; chat: `audio`,
  `modalities`, `functions`, `function_call`, `prediction`, `verbosity`, `web_search_options`,
  `moderation`, `prompt_cache_options`) is accepted only at its neutral value (null, or what
  means "off"), because common clients send such fields at their defaults on every call; any
  other value is rejected (400) naming the field.
- Logprobs follow OpenAI's limits: chat's `top_logprobs` in [0, 20] and only with
  `logprobs: true`; completions' `logprobs` in [0, 5]. With `echo` they cover the prompt's tokens
  too (the first one's is null), and `max_tokens: 0` answers the prompt alone, as lm-eval asks;
  vLLM's `prompt_logprobs` in [0, 20] on both. Neither prompt part is streamed (400).
- A required field that is missing, or an empty `messages` list or empty token-id `prompt`, is
  a 400 (there is nothing to run), like OpenAI; so are wrong values (every refusal is a 400).
- `top_k` follows vLLM: an integer >= 1 keeps the k most likely tokens; 0 or -1 turns it off.
- `seed` is any int64, as OpenAI's (a negative seed seeds `torch.Generator` with its unsigned
  64-bit pattern).
- `null` for an optional field means its default, as in OpenAI's API (`temperature: null`,
  `stream: null`, ...); where null has a meaning of its own it keeps it (`max_tokens: null`: as
  many tokens as the context leaves).
- OpenAI's metadata fields (`store`, `metadata`, `service_tier`, `safety_identifier`,
  `prompt_cache_key`, `prompt_cache_retention`, `user`, `stream_options.include_obfuscation`)
  are accepted and ignored: they do not change the output; each request logs the ones it sent
  at debug.
- A `developer` message is a `system` message (OpenAI's newer name for it); an assistant message
  as the SDK dumps it back (`refusal`, `audio`, `function_call`, `annotations` all null) is
  accepted.
- A user message's content may hold images as OpenAI's `{"type": "image_url", "image_url":
  {"url": ..., "detail": ...}}` parts; such a message keeps its parts, in order, for the chat
  template (infer.server.chat_images). `detail` ("auto", "low", "high") is accepted and ignored,
  as vLLM does: the model's processor sizes every image itself.
"""

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from infer.engine.grammar_spec import GrammarSpec, GrammarSpecError

# Custom pydantic error types; `infer.server.errors` maps them to statuses and OpenAI codes.
EMPTY_INPUT = "empty_input"  # an empty `messages` or token-id `prompt`: 400, nothing to run
UNSUPPORTED_VALUE = "unsupported_value"  # a valid OpenAI value this server does not implement: 400
INVALID_VALUE = "invalid_value"  # a value the API does not allow: 400

MAX_STOP_STRINGS = 4
# OpenAI's limits on the alternatives per token: chat's top_logprobs, completions' logprobs.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_SEED = 2**63 - 1
MAX_CHOICES = 128
# Prompts in one /v1/completions batch.
MAX_PROMPTS = 128
MIN_SEED = -(2**63)
# OpenAI request fields for the provider's bookkeeping, not the output: accepted, logged, ignored.
METADATA_FIELDS = (
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "user",
)

# vLLM's structured output fields on a request, in the order they validate; each guided_ field's
# constraint, as structured_outputs names it.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
VLLM_GRAMMAR_FIELDS = ("structured_outputs", *GUIDED_FIELDS)
# The fields that hold the output to a grammar: a request sends at most one of them.
OUTPUT_CONSTRAINTS = ("response_format", *VLLM_GRAMMAR_FIELDS)

logger = logging.getLogger(__name__)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_ids(value: Any, field: str, many: str) -> list[int]:
    """`value` as a token-id input of `field` (a list of integers >= 0, not empty), or the refusal
    that names what the field takes: a string, token ids, or `many` of either."""
    if not isinstance(value, list) or not all(_is_token_id(item) for item in value):
        raise PydanticCustomError(
            INVALID_VALUE,
            f"{field} must be a string, a list of token ids (integers >= 0), or {many} of either",
        )
    if not value:
        raise PydanticCustomError(EMPTY_INPUT, f"{field} must not be empty")
    return value


def _as_list(value: str | list[int] | list[str | list[int]]) -> list[str | list[int]]:
    """One text or token-id input, or a list of them, as a list of inputs."""
    is_batch = isinstance(value, list) and bool(value) and not isinstance(value[0], int)
    return list(value) if is_batch else [value]


def _holds_image_part(value: Any) -> bool:
    """Whether a prompt is (or lists) an image content part: OpenAI's chat and Responses shapes,
    or Hugging Face's."""
    parts = value if isinstance(value, list) else [value]
    return any(
        isinstance(part, dict) and part.get("type") in ("image_url", "input_image", "image") for part in parts
    )


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED_VALUE, message)


class _Strict(BaseModel):
    # allow_inf_nan=False: pydantic's JSON parser reads Infinity and NaN, which would pass
    # one-sided bounds such as `repetition_penalty > 0` and then fail inside the engine.
    # strict=True: a value of the wrong JSON type is refused, not coerced (`max_tokens: "4"`,
    # `max_tokens: true`, `stream: "yes"`, `temperature: true`); an integer still fills a float.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_defaults(cls, data: Any) -> Any:
        """`null` for a field that cannot hold None means "not sent": its default applies."""
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls.model_fields or _accepts_none(cls.model_fields[key])
        }


def _accepts_none(field) -> bool:
    annotation = field.annotation
    return annotation is Any or annotation is type(None) or type(None) in getattr(annotation, "__args__", ())


class StreamOptions(_Strict):
    # Adds a last chunk with `usage` (and `"usage": null` on every other chunk), as OpenAI does.
    include_usage: bool = False
    # OpenAI pads stream chunks against side channels; nothing here to obfuscate: ignored.
    include_obfuscation: bool | None = None


class _SamplingRequest(_Strict):
    """The fields that /v1/completions and /v1/chat/completions share."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Token id (a JSON object's keys are strings: "50256") -> bias in [-100, 100].
    logit_bias: dict[int, float] = Field(default_factory=dict)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    # vLLM extension: token ids that end the request besides the model's end-of-sequence ids.
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    # vLLM extension: generate through end-of-sequence tokens until the token limit (benchmarks).
    ignore_eos: bool = False
    # vLLM extension: no end of sequence, stop token or stop string before this many tokens.
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored (METADATA_FIELDS): the provider's bookkeeping, not the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Choices to generate for the prompt, each its own engine request (OpenAI's limit: 128).
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    # vLLM extension: requests reuse each other's prefix-cached tokens only under the same salt
    # (tenants that must not learn each other's prompts from cache timing).
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM extension: every prompt token's logprob, rank and this many most likely alternatives
    # (`prompt_logprobs`: per choice on completions, on the response on chat); not streamed.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Structured output (chat as OpenAI has it; completions as vLLM has it).
    response_format: "ResponseFormat | None" = None
    # vLLM's structured output: its `structured_outputs` object, and the top-level guided_* fields
    # it had before (v0.12 removed those, and now ignores them; older clients still send them).
    # At most one of these and a response_format that constrains (OUTPUT_CONSTRAINTS).
    structured_outputs: "StructuredOutputs | None" = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _vllm_grammar: GrammarSpec | None = PrivateAttr(None)

    # OpenAI fields we accept only at their neutral values: field -> the values that mean "off".
    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @field_validator("*")
    @classmethod
    def _neutral_values_only(cls, value: Any, info) -> Any:
        neutral = cls.NEUTRAL_VALUES.get(info.field_name)
        # `True == 1` and `False == 0` in Python: a bool matches only a bool (best_of=true is not 1).
        if neutral is not None and not any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral
        ):
            shown = " or ".join("null" if v is None else json.dumps(v) for v in neutral)
            raise _unsupported(f"{value!r} is not supported; leave {info.field_name} out or send {shown}")
        return value

    @model_validator(mode="after")
    def _log_ignored_metadata(self):
        sent = [name for name in METADATA_FIELDS if getattr(self, name) is not None]
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            sent.append("stream_options.include_obfuscation")
        if sent:
            logger.debug("ignoring OpenAI metadata fields %s", sorted(sent))
        return self

    @field_validator(*VLLM_GRAMMAR_FIELDS)
    @classmethod
    def _one_output_constraint(cls, value: Any, info) -> Any:
        # The fields validate in the order declared: info.data holds those before this one.
        if value is None:
            return value
        other = next(
            (
                name
                for name in OUTPUT_CONSTRAINTS
                if name != info.field_name and _constrains(info.data.get(name))
            ),
            None,
        )
        if other is not None:
            raise PydanticCustomError(
                INVALID_VALUE,
                "{field} and {other} both constrain the output; send one of them",
                {"field": info.field_name, "other": other},
            )
        if info.field_name in GUIDED_FIELDS:
            vllm_grammar(GUIDED_FIELDS[info.field_name], value)
        return value

    @model_validator(mode="after")
    def _build_vllm_grammar(self):
        if self.structured_outputs is not None:
            self._vllm_grammar = self.structured_outputs.grammar_spec
        for field, kind in GUIDED_FIELDS.items():
            if getattr(self, field) is not None:
                self._vllm_grammar = vllm_grammar(kind, getattr(self, field))
        return self

    @property
    def grammar_field(self) -> str | None:
        """The vLLM field that constrains the output (structured_outputs or a guided_ one), if
        one was sent."""
        return next((name for name in VLLM_GRAMMAR_FIELDS if getattr(self, name) is not None), None)

    @property
    def output_grammar(self) -> GrammarSpec | None:
        """What the engine holds the output to (response_format's or a vLLM field's); None: free."""
        if self.response_format is not None and self.response_format.grammar is not None:
            return self.response_format.grammar
        return self._vllm_grammar

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        # OpenAI allows one string or a list of strings; null means none.
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: list[str]) -> list[str]:
        if any(text == "" for text in value):
            raise PydanticCustomError(INVALID_VALUE, "every stop string must be non-empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids_non_negative(cls, value: list[int]) -> list[int]:
        if any(token_id < 0 for token_id in value):
            raise PydanticCustomError(INVALID_VALUE, "every stop token id must be >= 0")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, value: Any) -> Any:
        # Strict mode takes no "50256" for an int: read the keys here, as OpenAI sends them.
        if isinstance(value, dict):
            keys = list(value)
            if not all(isinstance(key, str) and key.isdigit() or isinstance(key, int) for key in keys):
                raise PydanticCustomError(INVALID_VALUE, 'logit_bias keys must be token ids ("50256")')
            return {int(key): bias for key, bias in value.items()}
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_values_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        if any(not -100 <= bias <= 100 for bias in value.values()):
            raise PydanticCustomError(INVALID_VALUE, "logit_bias values must be in [-100, 100]")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        # A field validator (not a model one) so the error names the field; `stream` comes first.
        if value is not None and not info.data.get("stream", False):
            raise PydanticCustomError(INVALID_VALUE, "stream_options is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info) -> int | None:
        if value is not None and info.data.get("stream", False):
            raise _unsupported("prompt_logprobs are not streamed; set stream to false to get them")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def _num_logprobs(self) -> int | None:
        """Alternatives per token for SamplingParams.logprobs; None: no logprobs."""
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token for SamplingParams.prompt_logprobs; None: none."""
        return self.prompt_logprobs

    def to_sampling_kwargs(self, *, max_new_tokens_default: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `infer.engine.SamplingParams`.

        `max_new_tokens_default` is used when the client set no token limit (chat, or an explicit
        null); the server passes the room left in the context. If both are missing the key is
        left out and SamplingParams' own default applies.
        """
        kwargs: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            # vLLM treats 0 and -1 alike (off); SamplingParams takes both, we send one spelling.
            "top_k": max(self.top_k, 0),
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": dict(self.logit_bias),
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": self._num_logprobs(),
            "prompt_logprobs": self.num_prompt_logprobs(),
            "grammar": self.output_grammar,
        }
        max_new_tokens = self._max_new_tokens()
        if max_new_tokens is None:
            max_new_tokens = max_new_tokens_default
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        return kwargs


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `prompt` is kept as given: a string, token ids, or a batch of
    either (`prompts` lists them in every case)."""

    # OpenAI fields we accept only at their neutral values: field -> the values that mean "off".
    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {"best_of": (1, None), "suffix": (None, "")}

    prompt: str | list[int] | list[str | list[int]]
    # Each choice's text starts with its prompt's text (before max_tokens, whose 0 needs it).
    echo: bool = False
    # OpenAI's default for the legacy completions endpoint; null means "as many as fit"; 0, with
    # echo, answers the prompt alone (with logprobs: the prompt's logprobs, lm-eval's loglikelihood).
    max_tokens: int | None = Field(16, ge=0)
    # The sampled token's logprob and this many most likely alternatives per token (OpenAI's
    # legacy format: tokens, token_logprobs, top_logprobs, text_offset).
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_or_batch(cls, value: Any) -> Any:
        # OpenAI takes a string, token ids, or a batch of either; a batch of one is just its prompt.
        if isinstance(value, list) and value and all(isinstance(item, str | list) for item in value):
            if len(value) > MAX_PROMPTS:
                raise PydanticCustomError(
                    INVALID_VALUE, f"a batch holds at most {MAX_PROMPTS} prompts, got {len(value)}"
                )
            batch = [cls._one_prompt(item) for item in value]
            return batch[0] if len(batch) == 1 else batch
        return cls._one_prompt(value)

    @staticmethod
    def _one_prompt(value: Any) -> str | list[int]:
        if isinstance(value, str):
            return value
        if _holds_image_part(value):
            raise _unsupported(
                "/v1/completions takes no images; send them as image_url content parts of a "
                "/v1/chat/completions message"
            )
        return _token_ids(value, "prompt", "a batch")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, one or a batch, in order."""
        return _as_list(self.prompt)

    @field_validator("max_tokens")
    @classmethod
    def _no_tokens_only_with_echo(cls, value: int | None, info) -> int | None:
        if value == 0 and not info.data.get("echo", False):
            raise PydanticCustomError(
                INVALID_VALUE, "max_tokens 0 answers nothing without echo; send 1 or more"
            )
        if value == 0 and info.data.get("stream", False):
            raise _unsupported("max_tokens 0 (the prompt alone) is not streamed; set stream to false")
        return value

    @field_validator("logprobs")
    @classmethod
    def _echoed_logprobs_not_streamed(cls, value: int | None, info) -> int | None:
        if value is not None and info.data.get("echo", False) and info.data.get("stream", False):
            raise _unsupported(
                "logprobs with echo (the prompt's logprobs) are not streamed; set stream to false"
            )
        return value

    @property
    def answers_prompt_only(self) -> bool:
        """max_tokens 0 with echo: the choices are their prompts, no token generated."""
        return self.max_tokens == 0

    def _max_new_tokens(self) -> int | None:
        # The engine runs at least one token: the prompt-only answer runs one and shows none.
        return 1 if self.answers_prompt_only else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        # With echo the logprobs cover the prompt's tokens too: its alternatives as well.
        asks = [self.prompt_logprobs, self.logprobs if self.echo else None]
        asks = [ask for ask in asks if ask is not None]
        return max(asks) if asks else None


# ----------------------------------------------------------------------------- chat


class ToolCallFunction(_Strict):
    name: str
    # A JSON-encoded string, as OpenAI sends it.
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str
    # OpenAI's resolution hint. The model's processor gives every image the same pixels and
    # tokens whatever it says, so it is accepted and ignored, as vLLM does.
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(_Strict):
    """One message. Text-only `content` is normalized to one string: text parts are joined by
    newlines (what vLLM does). Content with images stays a list of parts, in order."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # What the SDK dumps back with an assistant message; accepted when null (or, for refusal, as
    # text the model never sees: a refusal is not part of the conversation's content).
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: Any = None

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, value: str) -> str:
        # OpenAI's newer name for the system role; every chat template knows "system".
        return "system" if value == "developer" else value

    @field_validator("audio", "function_call")
    @classmethod
    def _null_only(cls, value: Any, info) -> Any:
        if value is not None:
            raise _unsupported(
                f"{info.field_name} is not supported here (send tool_calls for calls); leave it null"
            )
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_to_string(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        parts = []
        for index, part in enumerate(value):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type == "image_url":
                parts.append(_image_part(part, index))
                continue
            if part_type != "text":
                raise _unsupported(
                    f"content part {index} has type {part_type!r}; only "
                    '{"type": "text", "text": ...} and {"type": "image_url", "image_url": {"url": ...}} '
                    "parts are supported"
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise PydanticCustomError(
                    INVALID_VALUE,
                    f'content part {index} must be exactly {{"type": "text", "text": <string>}}',
                )
            parts.append(TextPart(type="text", text=part["text"]))
        if all(isinstance(part, TextPart) for part in parts):
            return "\n".join(part.text for part in parts)
        return parts

    @model_validator(mode="after")
    def _role_rules(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                INVALID_VALUE, f"a {self.role} message needs content (only assistant tool calls may omit it)"
            )
        if isinstance(self.content, list) and self.role != "user":
            # As OpenAI's API: images come from the user, never from the system, the model or a tool.
            raise PydanticCustomError(
                INVALID_VALUE, f"only user messages may hold image_url parts, not {self.role} messages"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError(
                INVALID_VALUE, f"only assistant messages carry tool_calls, not {self.role} messages"
            )
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError(INVALID_VALUE, "a tool message needs the tool_call_id it answers")
        return self


def _image_part(part: dict, index: int) -> ImagePart:
    try:
        return ImagePart.model_validate(part)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(key) for key in first["loc"])
        raise PydanticCustomError(
            INVALID_VALUE,
            f"content part {index}: {where}: {first['msg']}; an image part is "
            '{"type": "image_url", "image_url": {"url": <data: or http(s) URL>, "detail": "auto"}}',
        ) from None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    # A JSON Schema object, passed to the chat template as is. Any JSON here: that it is a schema
    # object is checked with the other tool rules (infer.server.chat_tools, a 400 like OpenAI's).
    parameters: Any = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this function."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. `strict` is accepted either way: the output is
    always held to the schema (never to less)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex")


class ResponseFormat(_Strict):
    """What the answer must be (structured output): OpenAI's `text`, `json_object` and
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, and the first design
    document's `{"type": "json_schema", "schema": ...}` and `{"type": "regex", "pattern": ...}`.
    A schema keyword or regex feature the engine cannot enforce is a 400 naming it."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    pattern: str | None = None
    _grammar: GrammarSpec | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _build_grammar(self) -> "ResponseFormat":
        if self.type not in RESPONSE_FORMAT_TYPES:
            raise PydanticCustomError(
                INVALID_VALUE, f"response_format type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}"
            )
        given = {
            name: value is not None
            for name, value in (
                ("json_schema", self.json_schema),
                ("schema", self.schema_),
                ("pattern", self.pattern),
            )
        }
        wanted = {
            "text": set(),
            "json_object": set(),
            "json_schema": {"json_schema", "schema"},
            "regex": {"pattern"},
        }
        stray = [name for name, present in given.items() if present and name not in wanted[self.type]]
        if stray:
            raise PydanticCustomError(INVALID_VALUE, f"response_format {self.type!r} takes no {stray[0]!r}")
        try:
            if self.type == "json_object":
                self._grammar = GrammarSpec.json_object()
            elif self.type == "json_schema":
                schemas = [self.json_schema.schema_ if self.json_schema is not None else None, self.schema_]
                given_schemas = [schema for schema in schemas if schema is not None]
                if len(given_schemas) > 1:
                    raise PydanticCustomError(
                        INVALID_VALUE,
                        "response_format has two schemas (json_schema.schema and schema); send one",
                    )
                schema = given_schemas[0] if given_schemas else None
                if schema is None:
                    raise PydanticCustomError(
                        INVALID_VALUE,
                        "response_format json_schema needs a schema: "
                        '{"json_schema": {"name": ..., "schema": {...}}}',
                    )
                self._grammar = GrammarSpec.json_schema(schema)
            elif self.type == "regex":
                if self.pattern is None:
                    raise PydanticCustomError(INVALID_VALUE, 'response_format regex needs a "pattern"')
                self._grammar = GrammarSpec.regex(self.pattern)
        except GrammarSpecError as error:
            raise PydanticCustomError(
                UNSUPPORTED_VALUE if error.keyword else INVALID_VALUE, str(error)
            ) from None
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        """What the engine holds the answer to; None for text."""
        return self._grammar


def _constrains(value: Any) -> bool:
    """Whether a validated OUTPUT_CONSTRAINTS field holds the output (response_format text does not)."""
    if isinstance(value, ResponseFormat):
        return value.grammar is not None
    return value is not None


def vllm_grammar(kind: str, value: Any) -> GrammarSpec:
    """The GrammarSpec of one of vLLM's constraints (`json`: a schema, as an object or as JSON
    text; `regex`; `choice`; `grammar`: Lark or GBNF), as structured_outputs and the guided_
    fields hold them. What cannot be enforced is a PydanticCustomError saying why."""
    try:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as error:
                    raise PydanticCustomError(
                        INVALID_VALUE,
                        "a JSON schema sent as a string must be JSON: {error}",
                        {"error": str(error)},
                    ) from None
            return GrammarSpec.json_schema(value)
        if kind == "regex":
            return GrammarSpec.regex(value)
        if kind == "choice":
            return GrammarSpec.choice(value)
        return GrammarSpec.cfg(value)
    except GrammarSpecError as error:
        raise PydanticCustomError(UNSUPPORTED_VALUE if error.keyword else INVALID_VALUE, str(error)) from None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one of `json`, `regex`,
    `choice`, `grammar` and `json_object: true` (vllm_grammar reads them). Of its options, those
    that change nothing here are accepted: `disable_fallback` (one backend, nothing to fall back
    to) and `disable_any_whitespace` (JSON is always compact); those that would change the
    output only at their neutral value (null or false)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: Any = None
    structural_tag: Any = None
    _grammar: GrammarSpec | None = PrivateAttr(None)

    @field_validator("json_", "regex", "choice", "grammar")
    @classmethod
    def _enforceable(cls, value: Any, info) -> Any:
        if value is not None:
            vllm_grammar(info.field_name.rstrip("_"), value)
        return value

    @field_validator("disable_additional_properties", "whitespace_pattern", "structural_tag")
    @classmethod
    def _neutral_only(cls, value: Any, info) -> Any:
        if value is None or value is False:
            return value
        raise _unsupported(f"{info.field_name} is not supported; leave it out or send null")

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [
            (name, value)
            for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar), ("json_object", self.json_object or None))
            if value is not None
        ]  # fmt: skip
        if len(given) != 1:
            raise PydanticCustomError(
                INVALID_VALUE,
                "structured_outputs takes exactly one of json, regex, choice, grammar and "
                "json_object: true; got {given}",
                {"given": ", ".join(name for name, _ in given) or "none"},
            )
        name, value = given[0]
        self._grammar = GrammarSpec.json_object() if name == "json_object" else vllm_grammar(name, value)
        return self

    @property
    def grammar_spec(self) -> GrammarSpec:
        return self._grammar


class ChatMessages:
    """What a request's `messages` (a list of ChatMessage) give the chat template and the image
    loader: one reading of them for /v1/chat/completions and /tokenize. A plain mixin (no fields):
    each request model declares `messages` itself."""

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for a chat template (unset fields left out, and the SDK's
        echo fields, which are not conversation). An image part is `{"type": "image"}`, as
        Hugging Face's chat templates take it: they write the model's image marker there."""
        echoed = {"refusal", "audio", "function_call", "annotations"}
        messages = []
        for message in self.messages:
            dumped = message.model_dump(exclude_none=True, exclude=echoed)
            if isinstance(message.content, list):
                dumped["content"] = [
                    {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
                    for part in message.content
                ]
            messages.append(dumped)
        return messages

    def image_urls(self) -> list[tuple[str, str]]:
        """(where it is, as an error's `param`; its URL) of every image part, in prompt order."""
        return [
            (f"messages.{message_index}.content.{part_index}.image_url.url", part.image_url.url)
            for message_index, message in enumerate(self.messages)
            if isinstance(message.content, list)
            for part_index, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        ]


class ChatCompletionRequest(_SamplingRequest, ChatMessages):
    """POST /v1/chat/completions."""

    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {
        "audio": (None,),
        "modalities": (None, ["text"]),
        "functions": (None,),
        "function_call": (None,),
        "prediction": (None,),
        "verbosity": (None,),
        "web_search_options": (None,),
        "moderation": (None,),
        "prompt_cache_options": (None,),
    }

    messages: list[ChatMessage]
    # `max_completion_tokens` is OpenAI's newer name for `max_tokens`; either may be sent.
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    # "auto" (the default with tools), "none", "required" or a NamedToolChoice; checked against
    # `tools` in infer.server.chat_tools.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # OpenAI's default (null too): several calls in one answer; false: at most one
    # (infer.server.chat_tools).
    parallel_tool_calls: bool | None = None
    # Passed to the chat template, e.g. {"enable_thinking": false} for Qwen 3.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # OpenAI's reasoning knob, mapped onto thinking where the model has it (Qwen 3): "none" and
    # "minimal" turn it off, the others on; an explicit chat_template_kwargs enable_thinking wins.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # Each content token's logprob (choices[].logprobs.content), with top_logprobs alternatives.
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # NEUTRAL_VALUES only: audio output, legacy functions, predicted outputs, GPT-5 verbosity,
    # web search, moderation, prompt caching options.
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None

    @field_validator("messages")
    @classmethod
    def _messages_non_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise PydanticCustomError(EMPTY_INPUT, "messages must hold at least one message")
        return value

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _null_kwargs_as_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        # One message for every wrong shape, rather than pydantic's error per union member.
        if value in (None, "none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (
            isinstance(value, dict)
            and set(value) == {"type", "function"}
            and value["type"] == "function"
            and isinstance(function, dict)
            and set(function) == {"name"}
            and isinstance(function["name"], str)
        ):
            return value
        raise PydanticCustomError(
            INVALID_VALUE,
            'tool_choice must be "none", "auto", "required" '
            'or {"type": "function", "function": {"name": ...}}',
        )

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_token_limit(cls, value: int | None, info) -> int | None:
        max_tokens = info.data.get("max_tokens")
        if value is not None and max_tokens is not None and value != max_tokens:
            raise PydanticCustomError(
                INVALID_VALUE,
                "disagrees with max_tokens ({a} vs {b}); send only max_completion_tokens",
                {"a": value, "b": max_tokens},
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info) -> int | None:
        # As OpenAI and vLLM: alternatives without the logprobs they belong to are a mistake.
        if value is not None and not info.data.get("logprobs", False):
            raise PydanticCustomError(INVALID_VALUE, "top_logprobs needs logprobs: true")
        return value

    def _max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: chat_template_kwargs, with enable_thinking from
        reasoning_effort when the client set one and not the other."""
        if self.reasoning_effort is None or "enable_thinking" in self.chat_template_kwargs:
            return dict(self.chat_template_kwargs)
        return {
            **self.chat_template_kwargs,
            "enable_thinking": self.reasoning_effort not in ("none", "minimal"),
        }


# ----------------------------------------------------------------------------- tokenizer


# The /tokenize fields that only a chat (`messages`) has.
TOKENIZE_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "tools",
)


# vLLM's /tokenize fields that ask for what this server does not do, and why: accepted only at
# null (or false, or {}).
_NOT_DONE_HERE = {
    "continue_final_message": "an open final message is not supported (the model's chat template "
    "closes every message); leave continue_final_message out or send false",
    "chat_template": "a request's own chat template is not supported: the server renders with the "
    "model's template; leave chat_template out",
    "mm_processor_kwargs": "processor arguments are not supported: the model's image processor sizes "
    "every image itself; leave mm_processor_kwargs out",
}


class TokenizeRequest(_Strict, ChatMessages):
    """POST /tokenize, vLLM's two bodies in one model: text (`prompt`, its TokenizeCompletionRequest)
    or a chat (`messages` and the chat fields, its TokenizeChatRequest). That exactly one of them
    is given, and no chat field with a prompt, is checked by the route (infer.server.routes_tokenize),
    which names the field. The messages and tools are read as /v1/chat/completions reads them."""

    # vLLM's /tokenize takes no model or null; a model named must be the served one.
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: the tokenizer's special tokens (BOS) on a prompt; none on top of what a chat
    # template writes.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    # Only at their neutral values (_NOT_DONE_HERE says why): a chat whose final message stays
    # open, a request's own Jinja template, arguments for vLLM's multimodal processor.
    continue_final_message: bool = False
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[Tool] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_non_empty(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value is not None and not value:
            raise PydanticCustomError(EMPTY_INPUT, "messages must hold at least one message")
        return value

    @field_validator("continue_final_message", "chat_template", "mm_processor_kwargs")
    @classmethod
    def _only_what_is_done_here(cls, value: Any, info) -> Any:
        if value is None or value is False or value == {}:
            return value
        raise _unsupported(_NOT_DONE_HERE[info.field_name])

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens: as sent, else vLLM's default for the
        shape (a prompt: yes; a chat, whose template writes its own BOS: no)."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables (chat_template_kwargs), as ChatCompletionRequest's."""
        return dict(self.chat_template_kwargs)


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's DetokenizeRequest): token ids to text. That each id is in the
    vocabulary is checked by the route, which has the tokenizer."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ----------------------------------------------------------------------------- embeddings

# OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings (OpenAI's shape): `input` as a string, token ids, or a list of either
    (`inputs` lists them in every case); `encoding_format` float or base64 (little-endian float32,
    what the official client asks for by default); `dimensions` only as the model's own width,
    which the route checks (no Matryoshka truncation here)."""

    model: str
    input: str | list[int] | list[str | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted and ignored, as OpenAI's bookkeeping

    @field_validator("input", mode="before")
    @classmethod
    def _input_or_batch(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(item, str | list) for item in value):
            if len(value) > MAX_EMBEDDING_INPUTS:
                raise PydanticCustomError(
                    INVALID_VALUE, f"input holds at most {MAX_EMBEDDING_INPUTS} items, got {len(value)}"
                )
            return [cls._one_input(item) for item in value]
        return cls._one_input(value)

    @staticmethod
    def _one_input(value: Any) -> str | list[int]:
        if isinstance(value, str):
            if not value:
                raise PydanticCustomError(EMPTY_INPUT, "input must not be an empty string")
            return value
        return _token_ids(value, "input", "a list")

    @property
    def inputs(self) -> list[str | list[int]]:
        """The request's inputs, one or many, in order."""
        return _as_list(self.input)
