"""OpenAI-style error bodies, and the one place that decides which HTTP status an error gets.

Every error the server returns, as a response or as an SSE event, has OpenAI's shape:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.

Statuses for a request body that fails validation (see `from_validation_error`):
- 400 `invalid_request_error`: the body is not JSON, not a JSON object, misses a required field,
  or has an empty `messages` / token-id `prompt` (there is nothing to run).
- 400 `invalid_request_error`: a field is unknown, or its value is invalid, of the wrong type, or
  not supported here. Every refusal is a 400, as OpenAI and vLLM answer: the `openai` client raises
  `BadRequestError` for 400 but `UnprocessableEntityError` for 422, which code catching
  `BadRequestError` misses (the first design document said 422; specs/api/README.md says why not).
Beyond validation: 404 for a model this server does not serve, 400 when the prompt and the token
limit do not fit the context, 413 for a body or a prompt over the server's size limits
(`infer.server.limits`), 503 when the waiting queue is full or the server drains (clients retry
503s), 500 for a bug; 499 (`CLIENT_CLOSED_REQUEST`) for a body whose client hung up first.
"""

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from infer.server.schemas import EMPTY_INPUT, INVALID_VALUE, UNSUPPORTED_VALUE

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# Status of a response nobody receives (nginx's "client closed request"); only the logs see it.
CLIENT_CLOSED_REQUEST = 499

# pydantic error type -> (HTTP status, OpenAI error code). Any other type: 400 "invalid_value".
_STATUS_AND_CODE = {
    "json_invalid": (400, "invalid_json"),
    "missing": (400, "missing_required_parameter"),
    EMPTY_INPUT: (400, "empty_input"),
    "extra_forbidden": (400, "unknown_parameter"),
    UNSUPPORTED_VALUE: (400, "unsupported_value"),
}
# pydantic's own messages ("Input should be ...") don't show the input; ours do, shortened.
_MAX_SHOWN_INPUT_CHARS = 80
_MAX_OWN_MESSAGE_CHARS = 400

RequestModel = TypeVar("RequestModel", bound=BaseModel)


@dataclass
class ApiError(Exception):
    """An error to send to the client: raise it anywhere in a handler, answer with `status`/`body()`."""

    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None

    def __post_init__(self):
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_request(model: type[RequestModel], raw_body: bytes | str) -> RequestModel:
    """Validate a raw request body as `model`, raising ApiError with the status rules above."""
    try:
        return model.model_validate_json(raw_body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def from_validation_error(exc: ValidationError) -> ApiError:
    """The first error of `exc`, as an ApiError naming its field (`param`, a dotted path such as
    `messages.0.content`); the message says how many more errors there were."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    error_type, loc, msg = first["type"], first["loc"], first["msg"]
    # Cut like any echoed input: an unknown key may be as long as the client likes.
    param = _shorten(".".join(str(part) for part in loc)) or None
    status, code = _STATUS_AND_CODE.get(error_type, (400, "invalid_value"))
    if error_type == "json_invalid":
        message = f"request body is not valid JSON: {first['ctx']['error']}"
    elif param is None and error_type in ("model_type", "model_attributes_type", "dict_type"):
        status, code = 400, "invalid_body"
        message = f"request body must be a JSON object: {msg}"
    elif error_type == "missing":
        message = f"missing required field '{param}'"
    elif error_type == "extra_forbidden":
        message = f"unknown field '{param}': it is not part of the API this server implements; remove it"
    elif error_type in (EMPTY_INPUT, UNSUPPORTED_VALUE, INVALID_VALUE):
        # Our own messages already say what was wrong and what to send; they may quote the value.
        message = f"{param or 'request'}: {_shorten(msg, _MAX_OWN_MESSAGE_CHARS)}"
    else:
        message = f"{param or 'request'}: {msg}, got {_shorten(repr(first['input']))}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ApiError(status, message, INVALID_REQUEST, param, code)


def model_not_found(model: str, served: list[str]) -> ApiError:
    return ApiError(
        404,
        f"model {_shorten(repr(model))} is not served here; use one of {served} (GET /v1/models lists them)",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def context_length_exceeded(
    prompt_tokens: int, max_new_tokens: int, max_model_len: int, prompt_field: str = "messages"
) -> ApiError:
    return ApiError(
        400,
        f"this model's context holds {max_model_len} tokens, but the prompt has {prompt_tokens} and "
        f"max_tokens asks for {max_new_tokens} more; shorten the prompt or lower max_tokens",
        INVALID_REQUEST,
        prompt_field,
        "context_length_exceeded",
    )


def queue_full(max_waiting_requests: int) -> ApiError:
    return ApiError(
        503,
        f"the server's waiting queue is full ({max_waiting_requests} requests); retry later",
        SERVER_ERROR,
        None,
        "queue_full",
    )


def cancelled_by_server() -> ApiError:
    """A request the server aborted itself (the drain deadline passed): not an answer, so a body
    gets this 503 and a stream this error event, never a 200 or finish_reason "abort"."""
    return ApiError(
        503,
        "the server is shutting down and cancelled this request before it finished; retry it",
        SERVER_ERROR,
        None,
        "server_draining",
    )


def engine_unavailable(what: str) -> ApiError:
    """The engine (its process) died or stopped answering while the request ran: the server
    cannot answer it, and will exit for its supervisor to restart it."""
    message = f"the engine stopped before this request finished: {_shorten(what)}"
    return ApiError(503, message, SERVER_ERROR, None, "engine_failed")


def internal_error(what: str) -> ApiError:
    return ApiError(500, f"internal server error: {what}", SERVER_ERROR, None, "internal_error")


def _shorten(text: str, max_chars: int = _MAX_SHOWN_INPUT_CHARS) -> str:
    if len(text) <= max_chars:
        return text
    return text[: max_chars - 3] + "..."
