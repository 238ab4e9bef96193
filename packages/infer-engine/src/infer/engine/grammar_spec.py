"""What a request's output must be (structured output): text matching a JSON schema, any JSON
object, a regular expression, or a Lark grammar (the server's forced tool calls: fixed text around
JSON arguments; a client's grammar, Lark or GBNF; one of a list of strings); and the JSON Schema
subset the engine enforces.

A `GrammarSpec` is plain data (it crosses to the engine process inside SamplingParams) and its own
cache key: a schema is held as compact JSON text in the order it was written, since the output
writes an object's properties in the order the schema declares them (as OpenAI's strict mode
does; sorted keys would have the model write `{"age"` before `{"name"`).

`check_json_schema` refuses, by name, every keyword the engine would not enforce: a schema the
engine cannot hold its output to is an error (a 400 naming the keyword), never a constraint
silently dropped. Keywords that only describe (title, description, examples, ...) are accepted
and change nothing. The constructors (`GrammarSpec.json_schema`, `.regex`) also have llguidance
build the grammar, without a tokenizer (cheap), so what it cannot enforce (a regex lookahead)
is refused where the request is read, not in the engine.
"""

import functools
import json
import re
from dataclasses import dataclass

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
LARK = "lark"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, LARK)

# Keywords that describe a value and never constrain it.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly",
     # OpenAPI's (pydantic writes it for a discriminated union): it names the property that tells
     # the oneOf's alternatives apart, whose const values already do so.
     "discriminator"}
)  # fmt: skip
# Keywords the engine enforces: every output of the grammar layer's random walks over the suite
# of docs/structured-output.md validated against them. `oneOf` only where no value can match two
# of its alternatives (llguidance proves it: distinct types, distinct const/enum values, closed
# objects with distinct required properties), since a grammar can only enforce it as `anyOf`;
# `uniqueItems` no grammar library enforces.
CONSTRAINTS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
     "maxItems", "enum", "const", "pattern", "minLength", "maxLength", "format", "minimum", "maximum",
     "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "$ref", "$defs",
     "definitions"}
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
    kind: str  # one of KINDS
    # JSON_SCHEMA: the schema as compact JSON text; REGEX: the pattern; LARK: the grammar
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        """The spec of a JSON schema, checked (GrammarSpecError if the engine cannot enforce it)."""
        check_json_schema(schema)
        spec = cls(JSON_SCHEMA, json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
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

    @classmethod
    def lark(cls, grammar: str) -> "GrammarSpec":
        """The spec of a grammar in llguidance's Lark dialect, whose JSON values are written by
        `lark_json` (so they hold the same subset, compact); GrammarSpecError if it does not
        build. The server composes these (a forced tool call: fixed text around the arguments)."""
        spec = cls(LARK, grammar)
        _check_grammar(spec)
        return spec

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        """The spec of an output that is exactly one of `options` (vLLM's `choice`)."""
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise GrammarSpecError("choice must be a non-empty list of strings")
        alternatives = " | ".join(json.dumps(option, ensure_ascii=False) for option in options)
        return cls.lark(f"start: {alternatives}\n")

    @classmethod
    def cfg(cls, grammar: str) -> "GrammarSpec":
        """The spec of a context-free grammar as clients send it (vLLM's `grammar`): llguidance's
        Lark dialect (`start: ...`), or GBNF, the EBNF of llama.cpp and xgrammar (`root ::= ...`),
        which llguidance's converter rewrites as Lark. GrammarSpecError with the reason when it
        is neither, or does not build."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarSpecError("a grammar must be a non-empty string")
        return cls.lark(_as_lark(grammar))

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def _as_lark(grammar: str) -> str:
    """`grammar` in Lark: as it is when it is Lark (it has a `start:` rule, or no GBNF `::=`
    rule at all, so that llguidance's own error explains it), else converted from GBNF."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if is_lark_syntax(grammar) or "::=" not in grammar:
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:  # the converter raises its own error type, and plain Exception
        raise GrammarSpecError(
            f"the grammar reads as GBNF (it has ::= rules) but does not convert: {error}"
        ) from None


def lark_json(schema: dict) -> str:
    """A Lark expression for a JSON value that matches `schema`, held to what
    `GrammarSpec.json_schema` holds (checked the same way: GrammarSpecError naming the keyword)."""
    GrammarSpec.json_schema(schema)
    return "%json " + json.dumps({**_prepared_schema(schema), "x-guidance": _JSON_OPTIONS})


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
    elif keyword in ("anyOf", "oneOf", "prefixItems"):
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
            _prepared_schema(json.loads(spec.source)), defaults=_JSON_OPTIONS
        )
    if spec.kind == JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.kind == LARK:
        return LLMatcher.grammar_from_lark(spec.source)
    return LLMatcher.grammar_from_regex(ascii_classes(spec.source))


def _prepared_schema(schema):
    """What llguidance is given for a schema: ASCII classes, oneOf's $refs inlined."""
    schema = _with_ascii_patterns(schema)
    return _one_of_refs_inlined(schema, schema)


def _one_of_refs_inlined(schema, root):
    """`schema` with each `oneOf` alternative that is a `$ref` replaced by the definition it
    names: llguidance proves alternatives disjoint only from what they hold, never through a
    `$ref`, and pydantic writes a discriminated union as a oneOf of `$ref`s."""
    if isinstance(schema, list):
        return [_one_of_refs_inlined(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    inlined = {key: _one_of_refs_inlined(value, root) for key, value in schema.items()}
    if isinstance(inlined.get("oneOf"), list):
        inlined["oneOf"] = [_definition(alternative, root) for alternative in inlined["oneOf"]]
    return inlined


def _definition(alternative, root):
    ref = alternative.get("$ref") if isinstance(alternative, dict) else None
    if not isinstance(ref, str) or set(alternative) - ANNOTATIONS != {"$ref"}:
        return alternative
    section, _, name = ref.removeprefix("#/").partition("/")
    definitions = (
        root.get(section) if isinstance(root, dict) and section in ("$defs", "definitions") else None
    )
    target = definitions.get(name) if isinstance(definitions, dict) else None
    # Not followed further: a definition that is itself a bare $ref keeps its $ref (and the
    # oneOf is refused as it was), so a cycle of $refs cannot loop here.
    return target if isinstance(target, dict) else alternative


def _check_grammar(spec: "GrammarSpec") -> None:
    """GrammarSpecError with llguidance's reason when it cannot build the grammar (a regex
    feature no automaton has, such as lookahead; a `oneOf` whose alternatives may overlap)."""
    reason = _grammar_error(spec)
    if reason is None:
        return
    if spec.kind == JSON_SCHEMA and "oneOf" in reason:
        path = _overlapping_one_of(json.loads(spec.source))
        raise GrammarSpecError(
            f"JSON Schema keyword 'oneOf' (at {path}) is supported only where no value can match two of "
            "its alternatives (different types, different const or enum values, or objects with "
            "additionalProperties false and different required properties); use anyOf if any match "
            "will do",
            keyword="oneOf",
            path=path,
        )
    what = "grammar" if spec.kind == LARK else spec.kind
    raise GrammarSpecError(f"the {what} cannot be enforced: {reason}")


def _grammar_error(spec: "GrammarSpec") -> str | None:
    from llguidance import LLMatcher

    grammar = llguidance_grammar(spec)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return _dead_at_start(grammar)
    # The first line says where; a regex's reason comes lines later, after a picture of it.
    first, *rest = messages[0].splitlines()
    reason = next((line.strip().removeprefix("error: ") for line in rest if line.startswith("error: ")), None)
    return f"{first} {reason}" if reason else first


def _dead_at_start(grammar: str) -> str | None:
    """Why no output at all matches the grammar, when llguidance finds no byte that may come first
    and no empty output (every way from the start runs into a rule that never ends, such as
    `a: a "x"`), asked over a vocabulary of bytes; None otherwise. Such a rule reached only after
    some output is not found here: the engine's matcher then allows nothing more there, and the
    answer ends."""
    from llguidance import LLMatcher

    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()  # what may come first; an error when nothing may
        if not matcher.is_error():
            return None
        return "no output matches it: every way from its start is a dead end (a rule that never ends)"
    return matcher.get_error().splitlines()[0]


class _ByteVocabulary:
    """A tokenizer for llguidance whose tokens are the 256 bytes and an end token: enough to ask a
    grammar what may come first, without a model's vocabulary."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([value]) for value in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_ByteVocabulary()))


def _overlapping_one_of(schema) -> str:
    """Where the first `oneOf` (in document order) that llguidance refuses alone is: each is
    tried with the root's definitions beside it, for the `$ref`s in it."""
    definitions = {
        key: schema[key] for key in ("$defs", "definitions") if isinstance(schema, dict) and key in schema
    }
    first = None
    for path, alternatives in _one_ofs(schema, ""):
        first = first or path
        alone = GrammarSpec(JSON_SCHEMA, json.dumps({"oneOf": alternatives, **definitions}))
        if _grammar_error(alone) is not None:
            return path
    return first or "oneOf"


def _one_ofs(schema, path: str):
    if isinstance(schema, dict):
        for key, value in schema.items():
            where = f"{path}.{key}" if path else key
            if key == "oneOf":
                yield where, value
            yield from _one_ofs(value, where)
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _one_ofs(item, f"{path}.{i}")
