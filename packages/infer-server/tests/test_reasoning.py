"""Qwen 3 thinking text split from the answer, on fixed answers, whole and streamed.

Oracle: the reasoning and content written out by hand. Streaming is checked by cutting each
answer at every character boundary (tags split across tokens) and one character at a time.
"""

import pytest

from infer.models.chat_template import chat_template_for
from infer.server.chat_output import ChatAnswer, ChatOutputParser, ContentPiece, ReasoningPiece
from infer.server.reasoning import ThinkSplitter, prompt_opens_reasoning
from infer.server.tool_parsers import HERMES, ParsedToolCall

# (answer, starts_in_reasoning, expected reasoning, expected content)
CASES = {
    "think-then-answer": ("<think>\nTwo plus two.\n</think>\n\nFour.", False, "Two plus two.", "Four."),
    "leading-whitespace": ("\n <think>why</think>because", False, "why", "because"),
    "no-think-block": ("Four.", False, None, "Four."),
    "empty-think-block": ("<think>\n\n</think>\n\nFour.", False, None, "Four."),
    "ends-while-thinking": ("<think>\nstill going", False, "still going", None),
    "think-tag-later-is-content": ("Four. <think>x</think>", False, None, "Four. <think>x</think>"),
    "partial-open-tag-only": ("<thi", False, None, "<thi"),
    "opened-in-the-prompt": ("Two plus two.\n</think>\n\nFour.", True, "Two plus two.", "Four."),
    "opened-in-the-prompt-never-closed": ("Two plus", True, "Two plus", None),
    "close-tag-look-alike": ("<think>a </thinker> b</think>c", False, "a </thinker> b", "c"),
    "unicode": ("<think>日本 😀</think>é", False, "日本 😀", "é"),
}


def _parser(starts_in_reasoning: bool) -> ChatOutputParser:
    return ChatOutputParser(thinking=True, starts_in_reasoning=starts_in_reasoning)


def _streamed(parser: ChatOutputParser, pieces: list[str]) -> ChatAnswer:
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    reasoning = "".join(p.text for p in out if isinstance(p, ReasoningPiece))
    content = "".join(p.text for p in out if isinstance(p, ContentPiece))
    return ChatAnswer(content or None, reasoning or None)


@pytest.mark.parametrize("case_id", list(CASES))
def test_whole_answer_splits_into_reasoning_and_content(case_id):
    text, starts_in_reasoning, reasoning, content = CASES[case_id]
    assert _parser(starts_in_reasoning).parse(text) == ChatAnswer(content, reasoning)


@pytest.mark.parametrize("case_id", list(CASES))
def test_streaming_cut_anywhere_gives_the_whole_split(case_id):
    text, starts_in_reasoning, reasoning, content = CASES[case_id]
    expected = ChatAnswer(content, reasoning)
    for cut in range(len(text) + 1):
        assert _streamed(_parser(starts_in_reasoning), [text[:cut], text[cut:]]) == expected, f"cut {cut}"
    assert _streamed(_parser(starts_in_reasoning), list(text)) == expected


def test_reasoning_streams_before_the_block_closes():
    splitter = ThinkSplitter()
    assert splitter.feed("<think>Let me") == [(True, "Let me")]
    assert splitter.feed(" see</thi") == [(True, " see")]  # "</thi" may be the closing tag
    assert splitter.feed("nk>Four") == [(False, "Four")]


def test_thinking_and_tool_calls_together():
    text = (
        "<think>\nI need the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    parser = ChatOutputParser(thinking=True, tool_format=HERMES, tool_names={"get_weather"})
    expected = ChatAnswer(None, "I need the weather.", [ParsedToolCall("get_weather", '{"city": "Paris"}')])
    assert parser.parse(text) == expected


def test_whether_the_qwen3_prompt_leaves_a_think_block_open():
    template = chat_template_for("qwen3")
    question = [{"role": "user", "content": "2 + 2?"}]
    assert not prompt_opens_reasoning(template.render(question, enable_thinking=True))
    assert not prompt_opens_reasoning(template.render(question, enable_thinking=False))
    assert prompt_opens_reasoning(template.render(question) + "<think>\n")
