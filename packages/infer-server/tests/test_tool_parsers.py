"""Tool calls read back from fixed model answers, one format per chat-template family.

Oracle: the calls and content written out by hand for each answer. Streaming is checked against
the whole parse by feeding every answer cut at every character boundary (and one character at a
time): the pieces must join to the same content and calls.
"""

import json

import pytest

from infer.server.chat_output import ChatAnswer, ChatOutputParser, ContentPiece, ReasoningPiece
from infer.server.tool_parsers import (
    GEMMA_TOOL_CODE,
    HERMES,
    LLAMA3_JSON,
    ParsedToolCall,
    partial_marker_length,
    tool_call_format,
)

TOOLS = {"get_weather", "get_time"}
PARIS = ParsedToolCall("get_weather", '{"city": "Paris"}')
ROME = ParsedToolCall("get_weather", '{"city": "Rome", "unit": "c"}')


def call(name: str, **arguments) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


# (format, model answer, expected content, expected calls)
CASES = {
    # -- Hermes (chatml, qwen3) ---------------------------------------------------------------
    "hermes-one-call": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [PARIS],
    ),
    "hermes-text-then-two-calls": (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>',
        "Let me check.",
        [PARIS, ROME],
    ),
    "hermes-no-arguments": (HERMES, '<tool_call>{"name": "get_time"}</tool_call>', None, [call("get_time")]),
    "hermes-arguments-as-json-string": (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [PARIS],
    ),
    "hermes-outer-brace-dropped": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        None,
        [PARIS],
    ),
    "hermes-unclosed-at-the-end": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        None,
        [PARIS],
    ),
    "hermes-unicode-arguments": (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 日本"}}</tool_call>',
        None,
        [call("get_weather", city="Zürich 日本")],
    ),
    "hermes-plain-text-with-angle-brackets": (HERMES, "a < b and <tool_c is not a tag", None, []),
    "hermes-bad-json": (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {city}}</tool_call>',
        None,
        [],
    ),
    "hermes-unknown-tool": (HERMES, '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', None, []),
    "hermes-missing-name": (HERMES, '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', None, []),
    "hermes-arguments-not-an-object": (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
        None,
        [],
    ),
    "hermes-one-good-one-bad": (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "nope"}</tool_call>',
        '<tool_call>{"name": "nope"}</tool_call>',
        [PARIS],
    ),
    "hermes-truncated-call": (HERMES, 'Sure <tool_call>{"name": "get_wea', None, []),
    # A call ends at the first closing tag outside a JSON string: the grammar of a forced call lets
    # a string hold any text, tags included.
    "hermes-closing-tag-inside-a-string": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>',
        None,
        [call("get_weather", city="a</tool_call>b")],
    ),
    "hermes-tags-and-escaped-quotes-inside-strings": (
        HERMES,
        'Hi <tool_call>{"name": "get_weather", "arguments": {"<tool_call>": "\\\\", '
        '"city": "say \\"</tool_call>\\" \\u003c/tool_call>"}}</tool_call> ok',
        "Hi  ok",
        [call("get_weather", **{"<tool_call>": "\\", "city": 'say "</tool_call>" </tool_call>'})],
    ),
    "hermes-closing-tag-inside-a-string-left-open-at-the-end": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call>"}}\n',
        None,
        [call("get_weather", city="</tool_call>")],
    ),
    # A quote left open does not run past its line (JSON strings hold no newline): the malformed
    # call is text, and the next call is read.
    "hermes-unclosed-quote-then-a-call": (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris}}\n</tool_call>',
        [PARIS],
    ),
    # -- Llama 3 JSON -----------------------------------------------------------------------------
    "llama3-one-call": (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [PARIS],
    ),
    "llama3-python-tag-and-two-calls": (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
        None,
        [PARIS, ROME],
    ),
    "llama3-arguments-key": (
        LLAMA3_JSON,
        ' {"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        None,
        [PARIS],
    ),
    "llama3-prose": (LLAMA3_JSON, "It is sunny in Paris.", None, []),
    "llama3-prose-mentioning-json": (LLAMA3_JSON, 'Send {"name": "get_weather"} to call it.', None, []),
    "llama3-call-then-prose": (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}} I called it.',
        None,
        [],
    ),
    "llama3-unknown-tool": (LLAMA3_JSON, '{"name": "launch", "parameters": {}}', None, []),
    "llama3-bad-json": (LLAMA3_JSON, '{"name": "get_weather", "parameters": {', None, []),
    # -- Gemma 3 tool_code ----------------------------------------------------------------------
    "gemma-one-call": (GEMMA_TOOL_CODE, '```tool_code\nget_weather(city="Paris")\n```', None, [PARIS]),
    "gemma-text-and-literals": (
        GEMMA_TOOL_CODE,
        "I will look it up.\n```tool_code\n"
        "get_weather(city='Rome', unit=\"c\", days=-2, ok=True, alt=null, "
        "tags=['a', 1.5], opts={'x': false})\n```",
        "I will look it up.",
        [
            call(
                "get_weather",
                city="Rome",
                unit="c",
                days=-2,
                ok=True,
                alt=None,
                tags=["a", 1.5],
                opts={"x": False},
            )
        ],
    ),
    "gemma-list-of-calls": (
        GEMMA_TOOL_CODE,
        '```tool_code\n[get_weather(city="Paris"), get_time()]\n```',
        None,
        [PARIS, call("get_time")],
    ),
    "gemma-two-lines": (
        GEMMA_TOOL_CODE,
        '```tool_code\nget_weather(city="Paris")\nget_time()\n```',
        None,
        [PARIS, call("get_time")],
    ),
    "gemma-unclosed-at-the-end": (
        GEMMA_TOOL_CODE,
        '```tool_code\nget_weather(city="Paris")\n',
        None,
        [PARIS],
    ),
    "gemma-positional-argument": (GEMMA_TOOL_CODE, '```tool_code\nget_weather("Paris")\n```', None, []),
    "gemma-unknown-function": (GEMMA_TOOL_CODE, "```tool_code\nos.system('rm')\n```", None, []),
    "gemma-not-python": (GEMMA_TOOL_CODE, "```tool_code\nget_weather(city=\n```", None, []),
    "gemma-expression-argument": (GEMMA_TOOL_CODE, "```tool_code\nget_weather(city=x + 1)\n```", None, []),
    "gemma-other-code-block": (GEMMA_TOOL_CODE, "```python\nprint(1)\n```", None, []),
    "gemma-fences-inside-strings": (
        GEMMA_TOOL_CODE,
        '```tool_code\nget_weather(city="a```b", unit=\'```\', note="\\"```")\n```',
        None,
        [call("get_weather", city="a```b", unit="```", note='"```')],
    ),
}


def _expected(case_id: str) -> ChatAnswer:
    _, text, content, calls = CASES[case_id]
    # Malformed answers (no calls expected and no content given) come back whole, as content.
    if content is None and not calls:
        content = text.strip()
    return ChatAnswer(content, None, calls)


def _streamed(parser: ChatOutputParser, pieces: list[str]) -> ChatAnswer:
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    content = "".join(p.text for p in out if isinstance(p, ContentPiece))
    assert not any(isinstance(p, ReasoningPiece) for p in out)
    return ChatAnswer(content or None, None, [p for p in out if isinstance(p, ParsedToolCall)])


@pytest.mark.parametrize("case_id", list(CASES))
def test_whole_answer_parses_to_the_expected_calls_and_content(case_id):
    tool_format, text, _, _ = CASES[case_id]
    assert ChatOutputParser(tool_format=tool_format, tool_names=TOOLS).parse(text) == _expected(case_id)


@pytest.mark.parametrize("case_id", list(CASES))
def test_streaming_cut_anywhere_gives_the_whole_answers_parse(case_id):
    tool_format, text, _, _ = CASES[case_id]
    expected = _expected(case_id)
    for cut in range(len(text) + 1):
        parser = ChatOutputParser(tool_format=tool_format, tool_names=TOOLS)
        assert _streamed(parser, [text[:cut], text[cut:]]) == expected, f"cut at {cut}"
    one_char_at_a_time = ChatOutputParser(tool_format=tool_format, tool_names=TOOLS)
    assert _streamed(one_char_at_a_time, list(text)) == expected


def test_text_that_may_open_a_call_is_held_back_and_released_when_it_does_not():
    parser = ChatOutputParser(tool_format=HERMES, tool_names=TOOLS)
    assert parser.feed("Hello <tool") == [ContentPiece("Hello")]  # " <tool" may be "<tool_call>"
    assert parser.feed("box> here") == [ContentPiece(" <toolbox> here")]


def test_a_call_is_emitted_as_soon_as_it_closes():
    parser = ChatOutputParser(tool_format=HERMES, tool_names=TOOLS)
    assert parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    assert parser.feed("</tool_call>\nmore") == [PARIS, ContentPiece("more")]
    assert parser.num_tool_calls == 1


def test_llama3_streams_prose_at_once_and_holds_json_to_the_end():
    prose = ChatOutputParser(tool_format=LLAMA3_JSON, tool_names=TOOLS)
    assert prose.feed("It is") == [ContentPiece("It is")]
    answer = ChatOutputParser(tool_format=LLAMA3_JSON, tool_names=TOOLS)
    assert answer.feed('{"name": "get_weather", "parameters": {"city": "Paris"}}') == []
    assert answer.finish() == [PARIS]


@pytest.mark.parametrize(
    ("tool_format", "model_writes"),
    [
        (HERMES, '{"city": "Paris"}}\n</tool_call>'),  # the grammar ends the call at its closing tag
        (HERMES, '{"city": "Paris"}}\n'),  # the closing tag cut off (max_tokens, a stop string)
        (LLAMA3_JSON, '{"city": "Paris"}}'),
        (GEMMA_TOOL_CODE, 'city="Paris")\n```'),
        (GEMMA_TOOL_CODE, 'city="Paris")\n'),
    ],
)
def test_a_forced_calls_prefix_is_part_of_the_answer(tool_format, model_writes):
    prefix = tool_format.named_call_prefix("get_weather")
    parser = ChatOutputParser(tool_format=tool_format, tool_names=TOOLS, call_prefix=prefix)
    assert parser.parse(model_writes) == ChatAnswer(None, None, [PARIS])
    malformed = ChatOutputParser(tool_format=tool_format, tool_names=TOOLS, call_prefix=prefix)
    assert malformed.parse("oops") == ChatAnswer((prefix + "oops").strip(), None, [])


@pytest.mark.parametrize(
    ("tool_format", "model_writes", "city"),
    [
        (HERMES, '{"city": "</tool_call>"}}\n</tool_call>', "</tool_call>"),
        (HERMES, '{"city": "x\\"</tool_call><tool_call>"}}\n</tool_call>', 'x"</tool_call><tool_call>'),
        (GEMMA_TOOL_CODE, 'city="```")\n```', "```"),
    ],
)
def test_a_forced_call_whose_string_holds_the_closing_marker_is_one_call(tool_format, model_writes, city):
    prefix = tool_format.named_call_prefix("get_weather")
    parser = ChatOutputParser(tool_format=tool_format, tool_names=TOOLS, call_prefix=prefix)
    assert parser.parse(model_writes) == ChatAnswer(None, None, [call("get_weather", city=city)])


def test_required_prefix_lets_the_model_pick_the_function():
    parser = ChatOutputParser(tool_format=HERMES, tool_names=TOOLS, call_prefix=HERMES.any_call_prefix)
    assert parser.parse('get_time", "arguments": {}}\n') == ChatAnswer(None, None, [call("get_time")])


def test_each_family_has_its_templates_format():
    assert tool_call_format("chatml") is HERMES
    assert tool_call_format("qwen3") is HERMES
    assert tool_call_format("llama3") is LLAMA3_JSON
    assert tool_call_format("gemma3") is GEMMA_TOOL_CODE
    with pytest.raises(ValueError, match="mistral"):
        tool_call_format("mistral")


@pytest.mark.parametrize(
    ("text", "expected"), [("abc<tool", 5), ("abc<", 1), ("abc", 0), ("<tool_call", 10), ("", 0)]
)
def test_partial_marker_length_is_the_longest_proper_start_of_the_marker(text, expected):
    assert partial_marker_length(text, "<tool_call>") == expected


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_a_lone_surrogate_in_the_arguments_stays_escaped_so_the_answer_can_be_sent(tool_format):
    """JSON lets a model write "\\ud800", a code point no UTF-8 body can carry: the arguments keep
    it escaped (json.loads gives the model's value back), and the text encodes as UTF-8."""
    body = '{"name": "get_weather", "arguments": {"city": "\\ud800 Paris \u00e9"}}'
    text = f"<tool_call>\n{body}\n</tool_call>" if tool_format is HERMES else body
    answer = ChatOutputParser(tool_format=tool_format, tool_names=TOOLS).parse(text)
    (parsed,) = answer.tool_calls
    assert json.loads(parsed.arguments) == {"city": "\ud800 Paris \u00e9"}
    json.dumps({"arguments": parsed.arguments}, ensure_ascii=False).encode("utf-8")  # raises if not
