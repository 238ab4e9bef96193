"""Anthropic's Messages API answers, built as plain dicts: the message, its content blocks, the
streamed events (SSE with `event:` lines) and the error object.

A chat answer (infer.server.chat_output) maps onto blocks in its order: reasoning is a
`thinking` block (its `signature` empty: nothing here signs it), content a `text` block, each
tool call a `tool_use` block whose `input` is the call's arguments as an object. The engine's
finish maps onto `stop_reason`: a stop token (the turn's end) `end_turn`, a stop string
`stop_sequence` (the string in `stop_sequence`), the token limit `max_tokens`, a parsed call
`tool_use`.

Errors are `{"type": "error", "error": {"type": ..., "message": ...}}`, the type by status as
Anthropic names them; the status is the server's own (specs/api/README.md), which the anthropic
client maps to its exception classes (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 413 ContentTooLargeError, 503 ServiceUnavailableError).
"""

import json
import uuid
from typing import Any

from infer.engine.output_processor import StepOutput
from infer.engine.protocol import FINISH_LENGTH
from infer.server.chat_output import ChatPiece, ContentPiece, ReasoningPiece
from infer.server.errors import ApiError
from infer.server.tool_parsers import ParsedToolCall

# HTTP status -> Anthropic's error type; any other 5xx is an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def error_body(status: int, message: str) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def api_error_body(error: ApiError) -> dict[str, Any]:
    return error_body(error.status, error.message)


def stop_reason(final: StepOutput, num_tool_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if num_tool_calls:
        return "tool_use", None
    if final.finish_reason == FINISH_LENGTH:
        return "max_tokens", None
    if final.stop_string is not None:
        return "stop_sequence", final.stop_string
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call: ParsedToolCall, input: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tool_use block; `input` defaults to the call's arguments (a streamed block starts with
    {} and gets them as an input_json_delta)."""
    return {
        "type": "tool_use",
        "id": new_tool_use_id(),
        "name": call.name,
        "input": json.loads(call.arguments) if input is None else input,
    }


def content_blocks(pieces: list[ChatPiece]) -> list[dict[str, Any]]:
    """A whole answer's blocks in the order its pieces came (as a stream sends them: a call the
    token limit cut short stays text after the calls before it), consecutive text or reasoning
    pieces in one block."""
    blocks: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, ContentPiece | ReasoningPiece):
            kind, field = ("text", "text") if isinstance(piece, ContentPiece) else ("thinking", "thinking")
            if not piece.text:
                continue
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][field] += piece.text
            else:
                blocks.append(text_block(piece.text) if kind == "text" else thinking_block(piece.text))
        else:
            blocks.append(tool_use_block(piece))
    return blocks


def message(
    id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event: `event: <its type>` and its JSON."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


def error_event(error: ApiError) -> bytes:
    return event(api_error_body(error))


class MessageEvents:
    """The events of one streamed message, from its pieces: `start`, `pieces` (as the parser
    gives them, or plain text), then `finish`. Consecutive pieces of one kind share a block."""

    def __init__(self, id: str, model: str, input_tokens: int):
        self.id, self.model, self.input_tokens = id, model, input_tokens
        self.num_blocks = 0
        self.open_kind: str | None = None  # "text" or "thinking" while such a block is open

    def start(self) -> bytes:
        body = message(self.id, self.model, [], None, None, usage(self.input_tokens, 0))
        return event({"type": "message_start", "message": body})

    def text(self, text: str) -> list[bytes]:
        return self._delta("text", text_block(""), {"type": "text_delta", "text": text})

    def pieces(self, pieces: list[ChatPiece]) -> list[bytes]:
        events: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, ContentPiece):
                events += self.text(piece.text)
            elif isinstance(piece, ReasoningPiece):
                delta = {"type": "thinking_delta", "thinking": piece.text}
                events += self._delta("thinking", thinking_block(""), delta)
            else:
                events += self._close()
                events.append(self._block_start(tool_use_block(piece, input={})))
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                events.append(self._block_delta(delta))
                events.append(self._block_stop())
        return events

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> list[bytes]:
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [
            *self._close(),
            event({"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}}),
            event({"type": "message_stop"}),
        ]

    def _delta(self, kind: str, empty_block: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        events = []
        if self.open_kind != kind:
            events += self._close()
            events.append(self._block_start(empty_block))
            self.open_kind = kind
        events.append(self._block_delta(delta))
        return events

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [self._block_stop()]

    def _block_start(self, block: dict[str, Any]) -> bytes:
        return event({"type": "content_block_start", "index": self.num_blocks, "content_block": block})

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self.num_blocks, "delta": delta})

    def _block_stop(self) -> bytes:
        self.num_blocks += 1
        return event({"type": "content_block_stop", "index": self.num_blocks - 1})
