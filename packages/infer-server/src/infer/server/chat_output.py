"""One chat answer's text -> content, reasoning_content and tool calls, streamed or whole.

model text -> (Qwen 3 thinking on) `ThinkSplitter` -> reasoning | content
content -> (tools in play) the family's `ToolCallParser` -> text | tool calls
Both texts come out stripped of surrounding whitespace (the newlines around `</think>` and
between tool calls are format, not answer), and an empty one is None, as OpenAI sends it.

A forced call's prefix (written into the prompt so the model only writes the arguments) is fed
first: it is part of the answer as far as parsing goes, and part of the content if the call
turns out malformed.
"""

from collections.abc import Collection
from dataclasses import dataclass, field

from infer.engine.protocol import FINISH_ABORT
from infer.server.reasoning import ThinkSplitter
from infer.server.tool_parsers import ParsedToolCall, ToolCallFormat, ToolCallParser

# The chat API's own finish_reason, beside the engine's (infer.engine.protocol's FINISH_*).
FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ContentPiece:
    text: str


@dataclass(frozen=True)
class ReasoningPiece:
    text: str


ChatPiece = ContentPiece | ReasoningPiece | ParsedToolCall


@dataclass
class ChatAnswer:
    """The non-streamed result: what a chat.completion message holds."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class StrippedText:
    """The streamed form of `"".join(pieces).strip()`: leading whitespace is dropped, trailing
    whitespace held until more text follows it, and dropped at the end."""

    def __init__(self):
        self.started, self.held = False, ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        self.held += text
        ready = self.held.rstrip()
        self.held = self.held[len(ready) :]
        return ready


@dataclass
class ChatOutputParser:
    """Parses one answer. `thinking`: split Qwen 3 reasoning; `tool_format` and `tool_names`: the
    calls to look for (None: no tools in play); `max_tool_calls`: the calls after that many are
    dropped (parallel_tool_calls false: one), as vLLM drops them; None keeps every one."""

    thinking: bool = False
    starts_in_reasoning: bool = False
    tool_format: ToolCallFormat | None = None
    tool_names: Collection[str] = ()
    call_prefix: str = ""
    max_tool_calls: int | None = None
    num_tool_calls: int = 0

    def __post_init__(self):
        self._splitter = (
            ThinkSplitter(starts_in_reasoning=self.starts_in_reasoning) if self.thinking else None
        )
        self._tools: ToolCallParser | None = (
            self.tool_format.parser(self.tool_names) if self.tool_format is not None else None
        )
        self._content, self._reasoning = StrippedText(), StrippedText()
        self._pending_prefix = self.call_prefix

    def feed(self, text: str) -> list[ChatPiece]:
        text, self._pending_prefix = self._pending_prefix + text, ""
        if self._splitter is None:
            return self._content_pieces(text, finished=False)
        return self._split(self._splitter.feed(text), finished=False)

    def finish(self) -> list[ChatPiece]:
        pieces = self.feed("")
        if self._splitter is not None:
            pieces += self._split(self._splitter.finish(), finished=True)
        else:
            pieces += self._content_pieces("", finished=True)
        return pieces

    def parse(self, text: str) -> ChatAnswer:
        """The whole answer at once (a fresh parser per answer)."""
        pieces = self.feed(text) + self.finish()
        content = "".join(piece.text for piece in pieces if isinstance(piece, ContentPiece))
        reasoning = "".join(piece.text for piece in pieces if isinstance(piece, ReasoningPiece))
        calls = [piece for piece in pieces if isinstance(piece, ParsedToolCall)]
        return ChatAnswer(content or None, reasoning or None, calls)

    def _split(self, split: list[tuple[bool, str]], *, finished: bool) -> list[ChatPiece]:
        pieces: list[ChatPiece] = []
        for is_reasoning, text in split:
            if is_reasoning:
                ready = self._reasoning.feed(text)
                if ready:
                    pieces.append(ReasoningPiece(ready))
            else:
                pieces += self._content_pieces(text, finished=False)
        if finished:
            pieces += self._content_pieces("", finished=True)
        return pieces

    def _content_pieces(self, text: str, *, finished: bool) -> list[ChatPiece]:
        if self._tools is None:
            parsed: list = [text]
        else:
            parsed = self._tools.feed(text) + (self._tools.finish() if finished else [])
        pieces: list[ChatPiece] = []
        for item in parsed:
            if isinstance(item, ParsedToolCall):
                if self.max_tool_calls is not None and self.num_tool_calls >= self.max_tool_calls:
                    continue
                self.num_tool_calls += 1
                pieces.append(item)
            else:
                ready = self._content.feed(item)
                if ready:
                    pieces.append(ContentPiece(ready))
        return pieces


def finish_reason(engine_finish_reason: str, num_tool_calls: int) -> str:
    """The answer's finish_reason: "tool_calls" once a call was parsed (as OpenAI), unless the
    request was aborted; otherwise the engine's own ("stop", "length", "abort")."""
    return (
        FINISH_TOOL_CALLS if num_tool_calls and engine_finish_reason != FINISH_ABORT else engine_finish_reason
    )
