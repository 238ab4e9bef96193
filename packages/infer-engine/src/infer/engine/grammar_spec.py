"""What a request's output must be (structured output): text matching a JSON schema, any JSON
object, or text matching a regular expression; and the JSON Schema subset the engine enforces.

A `GrammarSpec` is plain data (it crosses to the engine process inside SamplingParams) and its own
cache key: a schema is held as canonical JSON text (sorted keys, no spaces), so two requests with
the same schema written in another key order compile once.

`check_json_schema` refuses, by name, every keyword the engine would not enforce: a schema the
engine cannot hold its output to is an error (a 400 naming the keyword), never a constraint
silently dropped. Keywords that only describe (title, description, examples, ...) are accepted
and change nothing. The constructors (`GrammarSpec.json_schema`, `.regex`) also have llguidance
build the grammar, without a tokenizer (cheap), so what it cannot enforce (a regex lookahead)
is refused where the request is read, not in the engine.
"""

import json
import re
from dataclasses import dataclass

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"

# Keywords that describe a value and never constrain it.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly"}
)  # fmt: skip
# Keywords the engine enforces: every output of the grammar layer's random walks over the suite
# of docs/structured-output.md validated against them. `oneOf` is not among them yet: the grammar
# can only make it `anyOf`, which is wrong when two alternatives both match; `uniqueItems` no
# grammar library enforces.
CONSTRAINTS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
     "maxItems", "enum", "const", "pattern", "minLength", "maxLength", "format", "minimum", "maximum",
     "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "$ref", "$defs", "definitions"}
)  # fmt: skip
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
FORMATS = frozenset({"date", "date-time", "uuid", "email"})
# The most nested subschemas a schema may have: a bound on the compile work one request may cause.
MAX_DEPTH = 64


class GrammarSpecError(ValueError):
    """A schema or pattern the engine cannot enforce. `keyword` names the JSON Schema keyword at
    fault (None for a malformed pattern or schema); `path` is where it is, e.g.
    `properties.tags.items`."""

    def __init__(self, message: str, *, keyword: str | None = None, path: str = ""):
        super().__init__(message)
        self.keyword = keyword
        self.path = path


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # JSON_SCHEMA, JSON_OBJECT or REGEX
    source: str = ""  # JSON_SCHEMA: the schema as canonical JSON text; REGEX: the pattern

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        """The spec of a JSON schema, checked (GrammarSpecError if the engine cannot enforce it)."""
        check_json_schema(schema)
        spec = cls(JSON_SCHEMA, json.dumps(schema, sort_keys=True, separators=(",", ":")))
        _check_grammar(spec)
        return spec

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls(JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """The spec of a regular expression the whole output must match (GrammarSpecError if it
        does not compile)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarSpecError("a regex pattern must be a non-empty string")
        try:
            re.compile(pattern)
        except re.error as error:
            raise GrammarSpecError(f"the regex pattern does not compile: {error}") from None
        spec = cls(REGEX, pattern)
        _check_grammar(spec)
        return spec

    def __post_init__(self):
        if self.kind not in (JSON_SCHEMA, JSON_OBJECT, REGEX):
            raise ValueError(f"kind must be {JSON_SCHEMA}, {JSON_OBJECT} or {REGEX}, got {self.kind!r}")


def check_json_schema(schema: dict | bool) -> None:
    """Raises GrammarSpecError naming the first keyword (in document order) that the engine does
    not enforce, or a value it does not support (a `type` outside JSON's, a `format` it has no
    grammar for, a `$ref` outside the schema)."""
    _check(schema, "", 0)


def _check(schema, path: str, depth: int) -> None:
    if isinstance(schema, bool):
        return  # true: anything; false: nothing
    if not isinstance(schema, dict):
        raise GrammarSpecError(
            f"a schema must be an object or a boolean, got {_kind(schema)} at {path or 'the root'}"
        )
    if depth > MAX_DEPTH:
        raise GrammarSpecError(f"the schema nests deeper than {MAX_DEPTH} levels", path=path)
    for keyword, value in schema.items():
        where = f"{path}.{keyword}" if path else keyword
        if keyword in ANNOTATIONS:
            continue
        if keyword not in CONSTRAINTS:
            raise GrammarSpecError(
                f"JSON Schema keyword {keyword!r} (at {where}) is not supported by structured output; "
                f"supported: {', '.join(sorted(CONSTRAINTS))}",
                keyword=keyword,
                path=where,
            )
        _check_value(keyword, value, where, depth)


def _check_value(keyword: str, value, where: str, depth: int) -> None:
    def refuse(message: str):
        raise GrammarSpecError(f"{message} (at {where})", keyword=keyword, path=where)

    if keyword == "type":
        types = value if isinstance(value, list) else [value]
        if not types or any(t not in TYPES for t in types):
            refuse(f"type must be one of {', '.join(sorted(TYPES))} or a list of them, got {value!r}")
    elif keyword == "format":
        if value not in FORMATS:
            refuse(f"format {value!r} is not supported; supported: {', '.join(sorted(FORMATS))}")
    elif keyword in ("properties", "$defs", "definitions"):
        if not isinstance(value, dict):
            refuse(f"{keyword} must be an object of schemas")
        for name, subschema in value.items():
            _check(subschema, f"{where}.{name}", depth + 1)
    elif keyword in ("items", "additionalProperties"):
        if keyword == "items" and isinstance(value, list):
            refuse("items as a list (tuple validation) is not supported; give one schema for every item")
        _check(value, where, depth + 1)
    elif keyword in ("anyOf", "prefixItems"):
        if not isinstance(value, list) or not value:
            refuse(f"{keyword} must be a non-empty list of schemas")
        for i, subschema in enumerate(value):
            _check(subschema, f"{where}.{i}", depth + 1)
    elif keyword == "$ref":
        if not isinstance(value, str) or not (
            value == "#" or value.startswith(("#/$defs/", "#/definitions/"))
        ):
            refuse(f"$ref must point inside the schema (#, #/$defs/... or #/definitions/...), got {value!r}")
    elif keyword == "required":
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            refuse("required must be a list of property names")
    elif keyword == "enum":
        if not isinstance(value, list) or not value:
            refuse("enum must be a non-empty list")
    elif keyword == "pattern":
        try:
            re.compile(value)
        except (re.error, TypeError) as error:
            refuse(f"pattern does not compile: {error}")
    elif keyword in ("minItems", "maxItems", "minLength", "maxLength"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            refuse(f"{keyword} must be a non-negative integer, got {value!r}")
    elif keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            refuse(f"{keyword} must be a number, got {value!r}")
        if keyword == "multipleOf" and value <= 0:
            refuse(f"multipleOf must be > 0, got {value!r}")


def _kind(value) -> str:
    return type(value).__name__


# JSON is generated compact (no free whitespace): fewer tokens, and no run of spaces that a
# sampled model may never leave.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ASCII_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_"}


def ascii_classes(pattern: str) -> str:
    """`pattern` with `\\d` and `\\w` spelled as the ASCII classes they are in ECMA-262 (inside
    a character class too: `[\\d.]` -> `[0-9.]`)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped in _ASCII_CLASSES:
                spelled = _ASCII_CLASSES[escaped]
                out.append(spelled if in_class else f"[{spelled}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def _with_ascii_patterns(schema):
    if isinstance(schema, dict):
        return {
            key: ascii_classes(value)
            if key == "pattern" and isinstance(value, str)
            else _with_ascii_patterns(value)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_with_ascii_patterns(item) for item in schema]
    return schema


def llguidance_grammar(spec: "GrammarSpec") -> str:
    """The spec as an llguidance grammar (no tokenizer needed). Regular expressions (a regex
    spec, a schema's `pattern`) mean what they mean in JSON Schema (ECMA-262): `\\d` and `\\w` are
    ASCII, while llguidance's are Unicode (`\\d` matches `٥`), so they are spelled out."""
    from llguidance import LLMatcher

    if spec.kind == JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(
            _with_ascii_patterns(json.loads(spec.source)), defaults=_JSON_OPTIONS
        )
    if spec.kind == JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    return LLMatcher.grammar_from_regex(ascii_classes(spec.source))


def _check_grammar(spec: "GrammarSpec") -> None:
    """GrammarSpecError with llguidance's reason when it cannot build the grammar (a regex
    feature no automaton has, such as lookahead)."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(llguidance_grammar(spec))
    if is_error:
        raise GrammarSpecError(f"the {spec.kind} cannot be enforced: {messages[0].splitlines()[0]}")
