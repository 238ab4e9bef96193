"""Thinking text out of a Qwen 3 answer: `<think>...</think>` is reasoning, the rest is content.

Qwen 3 in thinking mode answers `<think>\\n...\\n</think>\\n\\nanswer`. A template may already have
opened the block in the prompt (then the answer starts inside it, with no `<think>` of its own):
`ThinkSplitter(starts_in_reasoning=True)`. Otherwise reasoning is only what follows a `<think>`
at the very start of the answer (after whitespace); an answer that does not start so is all
content, so it streams without waiting. An answer that ends inside the block (a token limit) is
all reasoning. Tags may arrive split across tokens: a possible partial tag is held back.

Like the tool parsers, feeding the whole text and then `finish()` is the non-streamed split.
"""

from infer.server.tool_parsers import partial_marker_length

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a think block open for the answer to continue."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ThinkSplitter:
    """Streams one answer into (is_reasoning, text) pieces."""

    def __init__(self, *, starts_in_reasoning: bool = False):
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.buffer = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self.buffer += text
        out: list[tuple[bool, str]] = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_OPEN):
                self.state = "reasoning"
                self.buffer = head[len(THINK_OPEN) :]
            elif head and not THINK_OPEN.startswith(head):
                self.state = "content"
            else:
                return out  # only whitespace, or a part of <think>, so far
        if self.state == "reasoning":
            end = self.buffer.find(THINK_CLOSE)
            if end < 0:
                keep = partial_marker_length(self.buffer, THINK_CLOSE)
                out.append((True, self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return [piece for piece in out if piece[1]]
            out.append((True, self.buffer[:end]))
            self.buffer, self.state = self.buffer[end + len(THINK_CLOSE) :], "content"
        out.append((False, self.buffer))
        self.buffer = ""
        return [piece for piece in out if piece[1]]

    def finish(self) -> list[tuple[bool, str]]:
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        return [(self.state == "reasoning", text)]
