"""The grammar of a forced tool call, on SmolLM2's real tokenizer: random walks through the tokens
it allows, after the call's opening the server writes, always read back by the family's own
parser (infer.server.tool_parsers) as exactly one call to an allowed tool, whose arguments
`jsonschema` validates against the tool's parameters. Neither oracle is the grammar itself."""

import json

import jsonschema
import pytest

from conformance import grammar_walks
from conformance.grammar_walks import closing_token_ids
from infer.engine.grammar import GrammarCompiler
from infer.models.load import load_model_info
from infer.server.tool_grammar import ToolSchemaError, forced_call_grammar
from infer.server.tool_parsers import GEMMA_TOOL_CODE, HERMES, LLAMA3_JSON, ParsedToolCall

MAX_TOKENS = 200
CLOSERS = ('"', "}", "]", ",", ")", "`")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
BOOKING = {
    "$defs": {"guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
              "vip": {"type": "boolean"}}, "required": ["name"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "guests": {"type": "array", "items": {"$ref": "#/$defs/guest"}, "minItems": 1, "maxItems": 2},
        "note": {"type": ["string", "null"], "maxLength": 10},
        "lead": {"$ref": "#/$defs/guest"},
    },
    "required": ["guests"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [("get_weather", WEATHER), ("book", BOOKING), ("ping", None)]
PARAMETERS = {name: parameters or {"type": "object", "maxProperties": 0} for name, parameters in TOOLS}
FORMATS = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "gemma_tool_code": GEMMA_TOOL_CODE}


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info("smollm2-135m-instruct").tokenizer.hf_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def closing_ids(tokenizer) -> frozenset[int]:
    return closing_token_ids(tokenizer, CLOSERS)


def random_walk(compiler, tokenizer, closing_ids, spec, seed) -> str | None:
    """Random allowed tokens (after 30, preferring closing ones, so walks end): the text, or None
    when the walk did not reach EOS."""
    ids, ended = grammar_walks.random_walk(
        compiler,
        spec,
        eos_token_id=tokenizer.eos_token_id,
        closing_ids=closing_ids,
        seed=seed,
        max_tokens=MAX_TOKENS,
        prefer_closing_after=30,
    )
    return tokenizer.decode(ids) if ended else None


def parsed_calls(tool_format, prefix: str, text: str, names=tuple(name for name, _ in TOOLS)) -> list:
    parser = tool_format.parser(names)
    return [piece for piece in parser.feed(prefix + text) + parser.finish() if piece != ""]


@pytest.mark.parametrize("forced_name", ["get_weather", "book", "ping", None])
@pytest.mark.parametrize("format_name", FORMATS)
def test_a_walk_through_a_forced_call_is_one_call_whose_arguments_validate(
    compiler, tokenizer, closing_ids, format_name, forced_name
):
    tool_format = FORMATS[format_name]
    spec = forced_call_grammar(tool_format, TOOLS, forced_name)
    prefix = tool_format.named_call_prefix(forced_name) if forced_name else tool_format.any_call_prefix
    finished, names = 0, set()
    for seed in range(6):
        text = random_walk(compiler, tokenizer, closing_ids, spec, seed)
        if text is None:
            continue
        finished += 1
        calls = parsed_calls(tool_format, prefix, text)
        assert len(calls) == 1 and isinstance(calls[0], ParsedToolCall), (text, calls)
        (call,) = calls
        assert forced_name is None or call.name == forced_name
        names.add(call.name)
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    assert finished >= 4
    if forced_name is None:
        assert len(names) >= 2, names  # "required" lets the model pick among the tools


def test_a_parameters_keyword_that_cannot_be_enforced_names_the_tools_field():
    tools = [("f", {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})]
    for tool_format in FORMATS.values():
        with pytest.raises(ToolSchemaError) as raised:
            forced_call_grammar(tool_format, tools, None)
        assert raised.value.keyword == "uniqueItems"
        assert raised.value.field == "tools.0.function.parameters.properties.tags.uniqueItems"


def test_only_the_named_function_is_checked_for_a_named_call():
    tools = [("f", {"type": "object", "properties": {"a": {"not": {}}}}), *TOOLS]
    forced_call_grammar(HERMES, tools, "get_weather")
    with pytest.raises(ToolSchemaError):
        forced_call_grammar(HERMES, tools, None)


def test_a_property_tool_code_cannot_name_is_refused_for_gemma_only():
    tools = [("f", {"type": "object", "properties": {"max-size": {"type": "integer"}}})]
    forced_call_grammar(HERMES, tools, "f")
    with pytest.raises(ToolSchemaError, match="max-size"):
        forced_call_grammar(GEMMA_TOOL_CODE, tools, "f")


def grammar_accepts(compiler, tokenizer, spec, text: str) -> bool:
    """Whether the output may be `text` (as the tokenizer splits it) and end there."""
    matcher = compiler.compile(spec).matcher()
    return all(matcher.advance(token) for token in tokenizer.encode(text, add_special_tokens=False)) and (
        matcher.is_terminal
    )


# What the model may write after a forced call's opening, a string holding the families' closing
# markers (and an opening): the grammar allows any text in a string. JSON as the grammar writes it
# (compact).
NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
ARGUMENTS = {"note": 'a</tool_call>b"<tool_call>```'}
ARGUMENTS_TEXT = json.dumps(ARGUMENTS, separators=(",", ":"))
MARKERS_IN_STRINGS = {
    "hermes": ARGUMENTS_TEXT + "}\n</tool_call>",
    "llama3_json": ARGUMENTS_TEXT + "}",
    "gemma_tool_code": f"note={json.dumps(ARGUMENTS['note'])})\n```",
}


@pytest.mark.parametrize("format_name", FORMATS)
def test_a_forced_call_the_grammar_accepts_parses_whatever_its_strings_hold(compiler, tokenizer, format_name):
    tool_format, text = FORMATS[format_name], MARKERS_IN_STRINGS[format_name]
    spec = forced_call_grammar(tool_format, [("write", NOTE)], "write")
    assert grammar_accepts(compiler, tokenizer, spec, text), text
    calls = parsed_calls(tool_format, tool_format.named_call_prefix("write"), text, ["write"])
    assert calls == [ParsedToolCall("write", json.dumps(ARGUMENTS))]


# -- several calls (parallel_tool_calls) ----------------------------------------------------------


def _calls_only(pieces: list) -> list:
    """The parsed pieces without the whitespace between calls (which the answer strips)."""
    return [piece for piece in pieces if not (isinstance(piece, str) and not piece.strip())]


@pytest.mark.parametrize("forced_name", ["get_weather", None])
@pytest.mark.parametrize("format_name", ["hermes", "gemma_tool_code"])
def test_a_walk_through_several_calls_is_calls_whose_arguments_each_validate(
    compiler, tokenizer, closing_ids, format_name, forced_name
):
    tool_format = FORMATS[format_name]
    spec = forced_call_grammar(tool_format, TOOLS, forced_name, several_calls=True)
    prefix = tool_format.named_call_prefix(forced_name) if forced_name else tool_format.any_call_prefix
    num_calls = []
    for seed in range(8):
        text = random_walk(compiler, tokenizer, closing_ids, spec, seed)
        if text is None:
            continue
        calls = _calls_only(parsed_calls(tool_format, prefix, text))
        assert calls and all(isinstance(call, ParsedToolCall) for call in calls), (text, calls)
        for call in calls:
            assert forced_name is None or call.name == forced_name
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
        num_calls.append(len(calls))
    assert len(num_calls) >= 4 and max(num_calls) >= 2, num_calls


SECOND_CALL = {
    "hermes": '\n<tool_call>\n{"name": "write", "arguments": {"note":"b"}}\n</tool_call>',
    "gemma_tool_code": '\n```tool_code\nwrite(note="b")\n```',
}


@pytest.mark.parametrize("format_name", SECOND_CALL)
def test_a_second_call_is_allowed_only_with_several_calls(compiler, tokenizer, format_name):
    tool_format = FORMATS[format_name]
    first = MARKERS_IN_STRINGS[format_name]
    for several_calls in (False, True):
        spec = forced_call_grammar(tool_format, [("write", NOTE)], "write", several_calls=several_calls)
        assert grammar_accepts(compiler, tokenizer, spec, first)
        assert grammar_accepts(compiler, tokenizer, spec, first + SECOND_CALL[format_name]) is several_calls


def test_llama3_json_holds_one_call_per_message_even_with_several_calls():
    # Its template renders exactly one call per assistant message: a second could not be sent back.
    for forced_name in ("get_weather", None):
        assert forced_call_grammar(
            LLAMA3_JSON, TOOLS, forced_name, several_calls=True
        ) == forced_call_grammar(LLAMA3_JSON, TOOLS, forced_name)
