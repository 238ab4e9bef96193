"""Tool calls out of model text, one format per chat-template family, streamed or whole.

Each family's template (infer-models templates/*.jinja) tells the model how to call a tool; the
parser here reads that format back:

- `HERMES` (chatml, qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  blocks, any number, with free text around them.
- `LLAMA3_JSON` (llama3): the whole answer is `{"name": ..., "parameters": {...}}` (several
  separated by `;` are accepted), optionally after `<|python_tag|>`.
- `GEMMA_TOOL_CODE` (gemma3): ```` ```tool_code\\nname(arg=value, ...)\\n``` ```` blocks of Python
  calls with literal keyword arguments.

A parser is fed the text as it is generated and returns what can be decided so far: plain text
(`str`) and complete calls (`ParsedToolCall`). Text that may be the start of a call is held back
until the call closes or proves not to be one. A call closes at the first closing marker outside
its string literals: a string may hold any text, markers included (a forced call's grammar
allows that), so every call that grammar allows is read back. A call that is malformed (bad JSON,
a name not among the request's tools, no name, arguments that are not an object) is given back
as the text it was, never an error. Feeding the whole text at once and then `finish()` is the non-streamed
parse, so streamed and whole answers agree by construction.
"""

import ast
import json
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

# JSON's literals, which a model may write inside Python-call arguments (tool_code).
_JSON_LITERAL_NAMES = {"true": True, "false": False, "null": None}


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


Parsed = str | ParsedToolCall


class ToolCallParser:
    """Streams one answer through a family's tool-call format (see the module docstring)."""

    def feed(self, text: str) -> list[Parsed]:
        raise NotImplementedError

    def finish(self) -> list[Parsed]:
        """What is still held back once the answer has ended."""
        raise NotImplementedError


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family's model writes a call: the parser, and the text that starts a call for the
    model when the request forces one (the model then only writes what follows)."""

    name: str
    make_parser: Callable[[Collection[str]], ToolCallParser]
    # prefix of a call to the named function, the model writing its arguments next
    named_call_prefix: Callable[[str], str]
    # prefix of a call to a function the model picks (tool_choice "required")
    any_call_prefix: str

    def parser(self, tool_names: Collection[str]) -> ToolCallParser:
        return self.make_parser(tool_names)


def _merge_text(pieces: list[Parsed]) -> list[Parsed]:
    merged: list[Parsed] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        elif piece != "":
            merged.append(piece)
    return merged


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0 if none):
    the text that must be held back because the marker may be arriving."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


# -- calls between an opening and a closing marker (Hermes, tool_code) ----------------------------


class _DelimitedCallParser(ToolCallParser):
    """`quotes`: the characters that open a string literal in a call's body (closed by the same
    character; a backslash escapes the next one)."""

    def __init__(
        self,
        tool_names: Collection[str],
        opening: str,
        closing: str,
        quotes: str,
        parse_body: Callable[[str, Collection[str]], list[ParsedToolCall] | None],
    ):
        self.tool_names, self.parse_body = tool_names, parse_body
        self.opening, self.closing, self.quotes = opening, closing, quotes
        self.buffer = ""
        self._enter_call(False)

    def feed(self, text: str) -> list[Parsed]:
        self.buffer += text
        out: list[Parsed] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(self.opening)
                if start < 0:
                    keep = partial_marker_length(self.buffer, self.opening)
                    out.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return _merge_text(out)
                out.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                self._enter_call(True)
            end = self._closing_position()
            if end < 0:
                return _merge_text(out)
            block = self.buffer[: end + len(self.closing)]
            out += self._block(block, self.buffer[len(self.opening) : end])
            self.buffer = self.buffer[len(block) :]
            self._enter_call(False)

    def finish(self) -> list[Parsed]:
        # An open call at the end: the model stopped before the closing marker (max_tokens, a
        # stop string). Its body may still be a whole call.
        block, self.buffer = self.buffer, ""
        if not self.in_call:
            return _merge_text([block])
        self._enter_call(False)
        return self._block(block, block[len(self.opening) :])

    def _enter_call(self, in_call: bool) -> None:
        """Starts (or leaves) a call at the start of the buffer: its body is scanned from after
        the opening, outside any string."""
        self.in_call = in_call
        self._scanned, self._quote, self._escaped = len(self.opening), None, False

    def _closing_position(self) -> int:
        """Where the first closing marker outside the body's string literals starts in the
        buffer, or -1 while there is none yet. The scan goes on from where the last one stopped.
        A newline ends a string left open (neither a JSON string nor a one-line Python string
        holds one), so a stray quote hides the markers of its own line only."""
        buffer, closing, position = self.buffer, self.closing, self._scanned
        while position < len(buffer):
            char = buffer[position]
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote or char == "\n":
                    self._quote = None
            elif buffer.startswith(closing, position):
                return position
            elif len(buffer) - position < len(closing) and closing.startswith(buffer[position:]):
                break  # the marker may be arriving: scan from here once more text comes
            elif char in self.quotes:
                self._quote = char
            position += 1
        self._scanned = position
        return -1

    def _block(self, block: str, body: str) -> list[Parsed]:
        calls = self.parse_body(body, self.tool_names)
        return list(calls) if calls else [block]


def _parse_hermes_body(body: str, tool_names: Collection[str]) -> list[ParsedToolCall] | None:
    body = body.strip()
    for candidate in (body, body + "}"):
        # The second: small models often close the arguments and then the tag, dropping the outer
        # brace ({"name": "f", "arguments": {"x": 1}\n</tool_call>); SmolLM2-135M does.
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        call = _call_from_json(value, tool_names, ("arguments", "parameters"))
        return [call] if call else None
    return None


def arguments_json(arguments: dict) -> str:
    """A call's arguments as JSON text, non-ASCII characters as themselves; a lone surrogate
    (JSON lets a model write `"\\ud800"`, which no UTF-8 response body can carry) stays escaped,
    so that the text still decodes to the same value and the response can always be sent."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(arguments)
    return text


def _call_from_json(
    value, tool_names: Collection[str], argument_keys: tuple[str, ...]
) -> ParsedToolCall | None:
    """A call from a decoded JSON object {"name", <one of argument_keys>}; None if malformed."""
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or name not in tool_names:
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, arguments_json(arguments))


# -- tool_code: Python calls ----------------------------------------------------------------------


def _parse_tool_code_body(body: str, tool_names: Collection[str]) -> list[ParsedToolCall] | None:
    try:
        module = ast.parse(body.strip())
    except (SyntaxError, ValueError):
        return None
    calls: list[ParsedToolCall] = []
    for statement in module.body:
        if not isinstance(statement, ast.Expr):
            return None
        # One call per line, or a list of calls (Google's `[f(a=1), g(b=2)]` form).
        nodes = (
            statement.value.elts if isinstance(statement.value, ast.List | ast.Tuple) else [statement.value]
        )
        for node in nodes:
            call = _python_call(node, tool_names)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def _python_call(node: ast.expr, tool_names: Collection[str]) -> ParsedToolCall | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in tool_names):
        return None
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        return None  # positional or **kwargs arguments have no names to send
    arguments = {}
    for keyword in node.keywords:
        try:
            arguments[keyword.arg] = _literal(keyword.value)
        except ValueError:
            return None
    return ParsedToolCall(node.func.id, arguments_json(arguments))


def _literal(node: ast.expr):
    """A JSON value from a Python literal (and JSON's own true/false/null); ValueError otherwise."""
    if isinstance(node, ast.Name) and node.id in _JSON_LITERAL_NAMES:
        return _JSON_LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError("a sign before something that is not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, str | bool | int) or _is_finite_float(value):
            return value
        raise ValueError(f"{value!r} is not a JSON value")
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [None if key is None else _literal(key) for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("a dict argument needs string keys to be JSON")
        return dict(zip(keys, (_literal(value) for value in node.values), strict=True))
    raise ValueError(f"{type(node).__name__} is not a literal")


def _is_finite_float(value) -> bool:
    return isinstance(value, float) and math.isfinite(value)


# -- Llama 3: the whole answer is JSON ------------------------------------------------------------


class _WholeAnswerJsonParser(ToolCallParser):
    """Llama 3.2's JSON function calling: an answer that starts with `{` (or `<|python_tag|>`) is
    held back whole and read as calls at the end; any other answer streams as text."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str]):
        self.tool_names = tool_names
        self.buffer = ""
        self.mode = "undecided"  # -> "calls" (hold everything) or "text" (pass everything)

    def feed(self, text: str) -> list[Parsed]:
        if self.mode == "text":
            return [text] if text else []
        self.buffer += text
        if self.mode == "undecided":
            start = self.buffer.lstrip()
            if start.startswith(("{", self.PYTHON_TAG)):
                self.mode = "calls"
            elif start and not self.PYTHON_TAG.startswith(start):
                self.mode = "text"
                text, self.buffer = self.buffer, ""
                return [text]
        return []

    def finish(self) -> list[Parsed]:
        text, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return [text] if text else []
        calls = _parse_json_calls(text.strip().removeprefix(self.PYTHON_TAG), self.tool_names)
        return list(calls) if calls else [text]


def _parse_json_calls(text: str, tool_names: Collection[str]) -> list[ParsedToolCall] | None:
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return calls or None
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        call = _call_from_json(value, tool_names, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


# -- the formats ------------------------------------------------------------------------------------

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CODE_OPEN, TOOL_CODE_CLOSE = "```tool_code", "```"

HERMES = ToolCallFormat(
    name="hermes",
    make_parser=lambda names: _DelimitedCallParser(names, HERMES_OPEN, HERMES_CLOSE, '"', _parse_hermes_body),
    named_call_prefix=lambda name: f'{HERMES_OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
    any_call_prefix=f'{HERMES_OPEN}\n{{"name": "',
)
LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    make_parser=_WholeAnswerJsonParser,
    named_call_prefix=lambda name: f'{{"name": {json.dumps(name)}, "parameters": ',
    any_call_prefix='{"name": "',
)
GEMMA_TOOL_CODE = ToolCallFormat(
    name="gemma_tool_code",
    make_parser=lambda names: _DelimitedCallParser(
        names, TOOL_CODE_OPEN, TOOL_CODE_CLOSE, "\"'", _parse_tool_code_body
    ),
    named_call_prefix=lambda name: f"{TOOL_CODE_OPEN}\n{name}(",
    any_call_prefix=f"{TOOL_CODE_OPEN}\n",
)
# Chat-template family (infer.models.chat_template) -> the call format its template teaches.
TOOL_CALL_FORMATS = {"chatml": HERMES, "qwen3": HERMES, "llama3": LLAMA3_JSON, "gemma3": GEMMA_TOOL_CODE}


def tool_call_format(family: str) -> ToolCallFormat:
    if family not in TOOL_CALL_FORMATS:
        raise ValueError(
            f"no tool-call format for chat template family {family!r}; known: {sorted(TOOL_CALL_FORMATS)}"
        )
    return TOOL_CALL_FORMATS[family]
