"""A /v1/responses answer, built as its text comes: the output items (reasoning, message,
function_call) in OpenAI's shapes, the typed stream events that announce them, and the whole
`response` object at the end. A body and a stream are built by the same `ResponseBuilder` from
the same pieces, so a streamed answer assembles into exactly the body the same request gets
without `stream`.

Pieces come from the chat route's reader (infer.server.chat_output): reasoning text opens a
`reasoning` item (its text in `content` as reasoning_text, `summary` empty), content text a
`message` item with one output_text part, each parsed tool call a `function_call` item (its
arguments in one delta). A new kind of piece closes the open item. Events follow OpenAI's order
(openai-python's types/responses/response_stream_event.py): response.created and
response.in_progress; per item output_item.added, (content_part.added, the deltas, the text's
done, content_part.done,) output_item.done; then response.completed, or response.incomplete when
the token limit cut the answer (status "incomplete", incomplete_details.reason
"max_output_tokens"), or response.failed when the engine could not finish it.
Every event carries `sequence_number`, counting from 0.

Plain dicts, as infer.server.responses builds the other routes' bodies; the tests parse them
with the `openai` client's own types.
"""

import uuid
from typing import Any

from infer.engine.protocol import FINISH_LENGTH
from infer.server.chat_output import ChatOutputParser, ContentPiece, ReasoningPiece
from infer.server.errors import ApiError
from infer.server.responses import new_tool_call_id
from infer.server.tool_parsers import ParsedToolCall


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: resp_, msg_, fc_, rs_ and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        # cache_write_tokens counts OpenAI's explicitly cached prompt writes (prompt_cache_options),
        # which are not done here: the prefix cache is automatic.
        "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


class ResponseBuilder:
    """One answer's output items and events. `response` holds the response object's fields that
    echo the request (id, created_at, model, tools, ...: `routes_responses` fills them); `parser`
    reads the answer's text (None: all of it is content, untouched)."""

    def __init__(self, response: dict[str, Any], parser: ChatOutputParser | None):
        self.response = {**response, "status": "in_progress", "output": [], "usage": None}
        self._parser = parser
        self._open: dict[str, Any] | None = None  # the item text is being added to
        self._sequence_number = 0
        self._pending_tokens = 0  # generated tokens not yet given to a piece
        self.num_reasoning_tokens = 0

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created"), self._event("response.in_progress")]

    def feed(self, text: str, num_tokens: int) -> list[dict[str, Any]]:
        """The events for the next text of the answer, generated as `num_tokens` tokens."""
        self._pending_tokens += num_tokens
        pieces = self._parser.feed(text) if self._parser is not None else [ContentPiece(text)] if text else []
        return self._add(pieces)

    def finish(
        self, finish_reason: str, *, input_tokens: int, output_tokens: int, cached_tokens: int
    ) -> list[dict[str, Any]]:
        """The events that end the answer: the rest of the text, the open item closed, then
        response.completed (or .incomplete, for a token limit); `usage` filled in."""
        events = self._add(self._parser.finish()) if self._parser is not None else []
        if not self.output:  # an empty answer is still a message, with empty text
            events += self._open_item("message")
        incomplete = finish_reason == FINISH_LENGTH
        events += self._close(incomplete=incomplete)
        self.response.update(
            status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=usage(input_tokens, output_tokens, cached_tokens, self.num_reasoning_tokens),
        )
        return events + [self._event("response.incomplete" if incomplete else "response.completed")]

    def failed(self, error: ApiError) -> list[dict[str, Any]]:
        """The event that ends an answer the engine could not finish (status "failed")."""
        self.response.update(status="failed", error={"code": "server_error", "message": error.message})
        return [self._event("response.failed")]

    # -- items ---------------------------------------------------------------------------------

    def _add(self, pieces: list) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, ReasoningPiece):
                self.num_reasoning_tokens += self._pending_tokens
            self._pending_tokens = 0
            if isinstance(piece, ParsedToolCall):
                events += self._close(incomplete=False) + self._function_call(piece)
                continue
            kind = "reasoning" if isinstance(piece, ReasoningPiece) else "message"
            if self._open is None or self._open["type"] != kind:
                events += self._close(incomplete=False) + self._open_item(kind)
            events.append(self._text_delta(piece.text))
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append({**item, "content": []})
        self._open = self.output[-1]
        added = self._item_event("response.output_item.added", {**item, "content": []})
        self._open["content"].append(part)
        return [added, self._part_event("response.content_part.added", dict(part))]

    def _text_delta(self, text: str) -> dict[str, Any]:
        part = self._open["content"][0]
        part["text"] += text
        if part["type"] == "output_text":
            return self._part_event("response.output_text.delta", None, delta=text, logprobs=[])
        return self._part_event("response.reasoning_text.delta", None, delta=text)

    def _close(self, *, incomplete: bool) -> list[dict[str, Any]]:
        """The events that close the open item (none when none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        if part["type"] == "output_text":
            done = self._part_event(
                "response.output_text.done", None, text=part["text"], logprobs=[], item=item
            )
        else:
            done = self._part_event("response.reasoning_text.done", None, text=part["text"], item=item)
        item["status"] = "incomplete" if incomplete else "completed"
        return [
            done,
            self._part_event("response.content_part.done", dict(part), item=item),
            self._item_event("response.output_item.done", dict(item)),
        ]

    def _function_call(self, call: ParsedToolCall) -> list[dict[str, Any]]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": new_tool_call_id(),
            "name": call.name,
        }
        self.output.append(item)
        added = self._item_event("response.output_item.added", dict(item))
        item.update(arguments=call.arguments, status="completed")
        where = {"item_id": item["id"], "output_index": self._index(item)}
        return [
            added,
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            ),
            self._item_event("response.output_item.done", dict(item)),
        ]

    # -- events --------------------------------------------------------------------------------

    def _index(self, item: dict[str, Any]) -> int:
        return next(index for index, output in enumerate(self.output) if output["id"] == item["id"])

    def _item_event(self, event_type: str, item: dict[str, Any]) -> dict[str, Any]:
        return self._event(event_type, output_index=self._index(item), item=item)

    def _part_event(
        self, event_type: str, part: dict[str, Any] | None, item: dict[str, Any] | None = None, **fields
    ) -> dict[str, Any]:
        """An event about the only content part of `item` (default: the open one)."""
        item = item if item is not None else self._open
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        if part is not None:
            fields["part"] = part
        return self._event(event_type, **where, **fields)

    def _event(self, event_type: str, **fields) -> dict[str, Any]:
        if event_type.startswith("response.") and event_type.count(".") == 1:
            fields["response"] = _snapshot(self.response)
        event = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event


def _snapshot(response: dict[str, Any]) -> dict[str, Any]:
    """The response as it stands (its items copied: later text must not change a sent event)."""
    return {
        **response,
        "output": [
            {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
            for item in response["output"]
        ],
    }
