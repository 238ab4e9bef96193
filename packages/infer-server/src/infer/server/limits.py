"""Size limits checked before any expensive work: the request body's bytes as it is read (413
before parsing), and a prompt's characters before it is tokenized (413 before the tokenizer
spends seconds and gigabytes on text that could never fit the context).

Tokenizing is the expensive step that nothing bounded before: a 20 MB prompt took 30-70 s and
left 5 GB of server memory behind. A prompt longer than `max_model_len` times the longest token
of the vocabulary (in characters) can never fit the context, so that product is the default
prompt limit: it never refuses a prompt that could have run.
"""

from dataclasses import dataclass

from starlette.requests import Request

from infer.server import errors
from infer.server.errors import ApiError

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


@dataclass(frozen=True)
class RequestLimits:
    # Bytes of one request body (`--max-request-bytes`).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Characters of one prompt before tokenizing (`--max-prompt-chars`); None: the context's
    # bound, max_model_len x the longest token in characters.
    max_prompt_chars: int | None = None

    def __post_init__(self):
        for name in ("max_request_bytes", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, or ApiError 413 as soon as it is known to exceed `max_bytes` (from
    Content-Length, else while reading), without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _body_too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _body_too_large(size, max_bytes, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def check_prompt_chars(num_chars: int, max_chars: int, field: str) -> None:
    """ApiError 413 naming `field` when a prompt of `num_chars` characters exceeds `max_chars`."""
    if num_chars > max_chars:
        raise ApiError(
            413,
            f"the prompt has {num_chars} characters, more than this server takes before tokenizing "
            f"({max_chars}, --max-prompt-chars); shorten it",
            errors.INVALID_REQUEST,
            field,
            "prompt_too_large",
        )


def _body_too_large(size: int, max_bytes: int, *, at_least: bool = False) -> ApiError:
    return ApiError(
        413,
        f"the request body is {'over ' if at_least else ''}{size} bytes, more than this server takes "
        f"({max_bytes}, --max-request-bytes); send a smaller request",
        errors.INVALID_REQUEST,
        None,
        "request_too_large",
    )
