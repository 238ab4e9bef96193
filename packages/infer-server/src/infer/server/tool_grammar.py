"""The grammar of a forced tool call (tool_choice "required" or a named function): what the model
may write after the call's opening, which the server has already written into the prompt
(`ToolCallFormat.named_call_prefix` / `any_call_prefix`).

The call is then always there, names one of the request's tools, and its arguments parse and
validate against that tool's `parameters` schema (the same JSON Schema subset as
`response_format`; a keyword outside it is a 400 naming the tool's field). The grammar ends where
the family's parser (infer.server.tool_parsers) closes the call, at the closing marker after the
arguments, and generation with it (the grammar then allows only EOS; a stop string would end a
call at a marker inside a string). A string may hold any text, markers included; the parser
closes a call at the first marker outside a string, so what the grammar allows is exactly what
that parser reads back as one call:

- Hermes: `<args>}` then `\\n</tool_call>`; for "required", the name's rest (`get_weather", `)
  and `"arguments": ` first.
- Llama 3 JSON: `<args>}`; for "required" the name's rest and `"parameters": ` first.
- Gemma tool_code: `name=<value>, ...)` then a newline and the closing fence, one keyword per
  declared property (required ones always, in their declared order), each value a JSON literal
  held to the property's schema (the parser reads JSON's true/false/null as Python's).

With parallel tool calls (the request's `parallel_tool_calls`, true unless sent false) the grammar
lets more calls follow the first, each a whole call held to the same rules, written as the
template writes several calls in one message; without, it ends the answer after the first.
"""

import json
import keyword
from typing import Any

from infer.engine.grammar_spec import GrammarSpec, GrammarSpecError, lark_json
from infer.server.tool_parsers import (
    GEMMA_TOOL_CODE,
    HERMES,
    HERMES_CLOSE,
    LLAMA3_JSON,
    TOOL_CODE_CLOSE,
    ToolCallFormat,
)

# A function declared without `parameters` takes none: its arguments are `{}`.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# What ends a call after its arguments, per format (the parser's closing marker included).
HERMES_END = "}\n" + HERMES_CLOSE
LLAMA3_END = "}"
TOOL_CODE_END = ")\n" + TOOL_CODE_CLOSE
# Between two calls of one message, as the chatml, qwen3 and gemma3 templates render them.
CALL_SEPARATOR = "\n"


class ToolSchemaError(ValueError):
    """A tool's parameters that no grammar can hold a call to; `field` is where (e.g.
    `tools.0.function.parameters.properties.x`), `keyword` the JSON Schema keyword at fault."""

    def __init__(self, message: str, field: str, keyword: str | None = None):
        super().__init__(message)
        self.field, self.keyword = field, keyword


def forced_call_grammar(
    tool_format: ToolCallFormat,
    tools: list[tuple[str, dict[str, Any] | None]],
    forced_name: str | None,
    *,
    several_calls: bool = False,
) -> GrammarSpec:
    """The grammar of the rest of a forced call. `tools`: (name, parameters) in the request's
    order; `forced_name`: the named function, or None for "required" (any of them).
    `several_calls` (parallel_tool_calls): after the first call, more calls of the same kind may
    follow, each opened as the template writes one after another (CALL_SEPARATOR, then the
    opening the server wrote for the first), before the answer ends; Llama 3's format holds one
    call per message (its template renders no more), so it stays one."""
    rules: list[str] = []
    alternatives = []
    for index, (name, parameters) in enumerate(tools):
        if forced_name is not None and name != forced_name:
            continue
        field = f"tools.{index}.function.parameters"
        try:
            body = _call_body(tool_format, parameters or NO_PARAMETERS, f"f{index}", rules, field)
        except GrammarSpecError as error:
            where = f"{field}.{error.path}" if error.path else field
            raise ToolSchemaError(f"{field}: {error}", where, error.keyword) from None
        opening = "" if forced_name is not None else _name_rest(tool_format, name)
        alternatives.append(f"{_literal(opening)} {body}" if opening else body)
    call = " | ".join(alternatives)
    if several_calls and tool_format is not LLAMA3_JSON:
        opening = (
            tool_format.named_call_prefix(forced_name)
            if forced_name is not None
            else tool_format.any_call_prefix
        )
        rules.append(f"call: {call}")
        call = f"call ({_literal(CALL_SEPARATOR + opening)} call)*"
    grammar = f"start: {call}\n" + "\n".join(rules) + "\n"
    return GrammarSpec.lark(grammar)


def _call_body(tool_format: ToolCallFormat, parameters: dict, rule: str, rules: list[str], field: str) -> str:
    """The Lark expression for one function's arguments and the call's end; helper rules go
    to `rules`, named from `rule`."""
    if tool_format is GEMMA_TOOL_CODE:
        return f"{_keyword_arguments(parameters, rule, rules, field)} {_literal(TOOL_CODE_END)}"
    rules.append(f"{rule}: {lark_json(parameters)}")
    if tool_format is HERMES:
        return f"{rule} {_literal(HERMES_END)}"
    if tool_format is LLAMA3_JSON:
        return f"{rule} {_literal(LLAMA3_END)}"
    raise ValueError(f"no forced-call grammar for tool-call format {tool_format.name!r}")


def _name_rest(tool_format: ToolCallFormat, name: str) -> str:
    """What follows `any_call_prefix` up to the arguments, for a call to `name`."""
    if tool_format is GEMMA_TOOL_CODE:
        return f"{name}("
    arguments_key = "parameters" if tool_format is LLAMA3_JSON else "arguments"
    # any_call_prefix ends inside the name's opening quote: `{"name": "`.
    return f"{json.dumps(name, ensure_ascii=False)[1:]}, {json.dumps(arguments_key)}: "


def _keyword_arguments(parameters: dict, rule: str, rules: list[str], field: str) -> str:
    """`a=<json>, b=<json>` over the declared properties in order: required ones always, the
    others optional; a comma between two present ones only."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    items = []
    for position, (name, schema) in enumerate(properties.items()):
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ToolSchemaError(
                f"{field}.properties: property {name!r} cannot be a keyword argument of the model's "
                "tool_code call (Python identifiers only), so the call cannot be forced",
                f"{field}.properties",
            )
        value_schema = {} if schema is True else schema
        if schema is False:
            if name in required:
                raise ToolSchemaError(f"{field}.properties.{name}: required but its schema is false", field)
            continue
        value = f"{rule}_{position}"
        # The property's own $refs point at the parameters' definitions: they come along.
        try:
            rules.append(f"{value}: {lark_json({**value_schema, **definitions})}")
        except GrammarSpecError as error:
            path = f"properties.{name}" + (f".{error.path}" if error.path else "")
            raise GrammarSpecError(str(error), keyword=error.keyword, path=path) from None
        items.append((name, value, name in required))
    # The first present argument has no comma before it; it is any one up to the first required.
    alternatives = []
    for first, (name, value, is_required) in enumerate(items):
        rest = " ".join(
            f"({_literal(f', {later}=')} {later_value})" + ("" if later_required else "?")
            for later, later_value, later_required in items[first + 1 :]
        )
        alternatives.append(f"{_literal(f'{name}=')} {value} {rest}".strip())
        if is_required:
            break
    else:
        alternatives.append('""')  # no argument at all: nothing is required
    return "(" + " | ".join(alternatives) + ")"


def _literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)
