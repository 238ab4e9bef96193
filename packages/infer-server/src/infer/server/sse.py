"""Server-sent events for streamed responses, with a fast path for the per-token chunks.

A stream sends one `data: <JSON chunk>\\n\\n` event per token. Serializing the whole chunk with
json.dumps costs microseconds, yet all of it but the text (and the token ids) stays the same for
the whole stream. So each stream serializes its chunk once with placeholder slots, cuts the bytes
at the slots, and per token only escapes the text with the C escaper json.dumps itself uses
(`json.encoder.encode_basestring`, the ensure_ascii=False one) and joins byte strings.

A chunk that carries logprobs (the client asked for them) is built whole and serialized with
`event`: it is not the hot path, and its token texts would need slots of their own.

The output is byte-for-byte `event(chunk)` for the chunk dict that `infer.server.responses` builds
(tests/test_sse.py proves it over arbitrary text). Text with a lone surrogate cannot be UTF-8
encoded: both paths raise UnicodeEncodeError (tokenizer output never holds one; decoding replaces
bad bytes with U+FFFD).

Usage, per request:
    stream = ChatStream(id, created, model, include_usage=req.include_usage)
    yield stream.role()
    for text in pieces: yield stream.content(text)   # or .reasoning(text), .tool_call(...)
    yield stream.finish("stop")
    if req.include_usage: yield stream.usage(responses.usage(prompt_tokens, completion_tokens))
    yield DONE
"""

import json
import uuid
from json.encoder import encode_basestring
from typing import Any

from infer.server import responses
from infer.server.errors import ApiError

DONE = b"data: [DONE]\n\n"

# Placeholders that json escapes to themselves; the uuid keeps them out of any model name or id.
_TEXT_SLOT = f"infer-sse-text-slot-{uuid.uuid4().hex}"
_TOKEN_IDS_SLOT = f"infer-sse-token-ids-slot-{uuid.uuid4().hex}"


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as compact JSON (the reference the fast path matches)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_event(error: ApiError) -> bytes:
    """An error in the middle of a stream, sent in place of further chunks (then DONE)."""
    return event(error.body())


class _SlottedChunk:
    """One chunk serialized once, cut at its text slot and, if present, at its token-ids slot
    (which the builders in `responses` always place after the text)."""

    def __init__(self, chunk: dict[str, Any]):
        line = event(chunk)
        self.head, rest = _split_once(line, encode_basestring(_TEXT_SLOT).encode())
        ids_slot = encode_basestring(_TOKEN_IDS_SLOT).encode()
        self.middle, self.tail = _split_once(rest, ids_slot) if ids_slot in rest else (b"", rest)

    def splice(self, text: str, token_ids: list[int]) -> bytes:
        ids_json = ("[" + ",".join(map(int.__repr__, token_ids)) + "]").encode()  # as json.dumps writes ints
        return self.head + encode_basestring(text).encode() + self.middle + ids_json + self.tail


def _split_once(line: bytes, slot: bytes) -> tuple[bytes, bytes]:
    parts = line.split(slot)
    if len(parts) != 2:
        raise ValueError(f"a chunk template must hold its slot once, found it {len(parts) - 1} times")
    return parts[0], parts[1]


class _Stream:
    object: str

    def __init__(self, id: str, created: int, model: str, *, include_usage: bool = False, index: int = 0):
        """`index`: the choice this stream's chunks belong to (n > 1 streams one per choice)."""
        self.id, self.created, self.model, self.include_usage = id, created, model, include_usage
        self.index = index

    def _build_templates(self, chunk_with_slots) -> None:
        # The text-only path is the hot one: its two constant byte strings live on self.
        plain = _SlottedChunk(chunk_with_slots(None))
        self._head, self._tail = plain.head, plain.tail
        self._with_ids = _SlottedChunk(chunk_with_slots(_TOKEN_IDS_SLOT))

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The last chunk when the client asked for usage: no choices, only `usage`."""
        return event(responses.usage_chunk(self.object, self.id, self.created, self.model, usage))


class CompletionStream(_Stream):
    """The events of one streamed /v1/completions response."""

    object = "text_completion"

    def __init__(self, id: str, created: int, model: str, *, include_usage: bool = False, index: int = 0):
        super().__init__(id, created, model, include_usage=include_usage, index=index)
        self._build_templates(
            lambda token_ids: responses.completion_chunk(
                id, created, model, _TEXT_SLOT, None, token_ids, include_usage, index
            )
        )

    def text(self, text: str, token_ids: list[int] | None = None, logprobs: dict | None = None) -> bytes:
        """A chunk with the next piece of text (and, if given, the token ids it came from and
        their logprobs)."""
        if logprobs is not None:
            return self._chunk(text, None, token_ids, logprobs)
        if token_ids is None:
            return self._head + encode_basestring(text).encode() + self._tail
        return self._with_ids.splice(text, token_ids)

    def finish(
        self,
        finish_reason: str,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: dict | None = None,
    ) -> bytes:
        """The chunk that ends the choice, with any text the last step produced."""
        return self._chunk(text, finish_reason, token_ids, logprobs)

    def _chunk(
        self, text: str, finish_reason: str | None, token_ids: list[int] | None, logprobs: dict | None
    ) -> bytes:
        """Any chunk, built whole (the slow path)."""
        chunk = responses.completion_chunk(
            self.id,
            self.created,
            self.model,
            text,
            finish_reason,
            token_ids,
            self.include_usage,
            self.index,
            logprobs=logprobs,
        )
        return event(chunk)


class ChatStream(_Stream):
    """The events of one streamed /v1/chat/completions response."""

    object = "chat.completion.chunk"

    def __init__(self, id: str, created: int, model: str, *, include_usage: bool = False, index: int = 0):
        super().__init__(id, created, model, include_usage=include_usage, index=index)
        self._build_templates(
            lambda token_ids: responses.chat_chunk(
                id, created, model, {"content": _TEXT_SLOT}, None, token_ids, include_usage, index
            )
        )
        # A thinking model streams reasoning as fast as content: it gets the fast path too.
        self._reasoning_plain, self._reasoning_with_ids = (
            _SlottedChunk(
                responses.chat_chunk(
                    id,
                    created,
                    model,
                    {"reasoning_content": _TEXT_SLOT},
                    None,
                    token_ids,
                    include_usage,
                    index,
                )
            )
            for token_ids in (None, _TOKEN_IDS_SLOT)
        )

    def role(self, role: str = "assistant") -> bytes:
        """The first chunk: the role, and empty content (what OpenAI sends first)."""
        delta = {"role": role, "content": ""}
        chunk = responses.chat_chunk(
            self.id, self.created, self.model, delta, None, None, self.include_usage, self.index
        )
        return event(chunk)

    def content(self, text: str, token_ids: list[int] | None = None, logprobs: dict | None = None) -> bytes:
        """A chunk with the next piece of content (and, if given, the token ids it came from and
        their logprobs)."""
        if logprobs is not None:
            return self._chunk({"content": text}, None, token_ids, logprobs)
        if token_ids is None:
            return self._head + encode_basestring(text).encode() + self._tail
        return self._with_ids.splice(text, token_ids)

    def reasoning(self, text: str, token_ids: list[int] | None = None, logprobs: dict | None = None) -> bytes:
        """A chunk with the next piece of reasoning (`delta.reasoning_content`)."""
        if logprobs is not None:
            return self._chunk({"reasoning_content": text}, None, token_ids, logprobs)
        if token_ids is None:
            plain = self._reasoning_plain
            return plain.head + encode_basestring(text).encode() + plain.tail
        return self._reasoning_with_ids.splice(text, token_ids)

    def tool_call(
        self,
        index: int,
        call_id: str,
        name: str,
        arguments: str,
        token_ids: list[int] | None = None,
        logprobs: dict | None = None,
    ) -> bytes:
        """A chunk carrying one whole tool call, the answer's `index`-th (rare: plain json.dumps)."""
        delta = responses.tool_call_delta(index, call_id, name, arguments)
        return self._chunk(delta, None, token_ids, logprobs)

    def finish(
        self,
        finish_reason: str,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: dict | None = None,
    ) -> bytes:
        """The chunk that ends the choice: delta {} or, if the last step produced text, its content."""
        delta = {"content": text} if text else {}
        return self._chunk(delta, finish_reason, token_ids, logprobs)

    def _chunk(
        self, delta: dict, finish_reason: str | None, token_ids: list[int] | None, logprobs: dict | None
    ) -> bytes:
        """Any chunk, built whole (the slow path)."""
        chunk = responses.chat_chunk(
            self.id,
            self.created,
            self.model,
            delta,
            finish_reason,
            token_ids,
            self.include_usage,
            self.index,
            logprobs=logprobs,
        )
        return event(chunk)
