"""The grammar layer on SmolLM2's real tokenizer: random walks through the allowed tokens end in
text that `jsonschema` / `re.fullmatch` (never the grammar itself) accept; a forbidden token is
refused; a token crossing a grammar boundary is allowed exactly when its whole text fits."""

import functools
import json
import re

import jsonschema
import pytest
import torch

from conformance import grammar_walks
from conformance.grammar_walks import allowed_ids, closing_token_ids
from infer.engine.grammar import GrammarCompiler
from infer.engine.grammar_spec import GrammarSpec, GrammarSpecError, ascii_classes
from infer.models.load import load_model_info

MAX_TOKENS = 300
CLOSERS = ('"', "}", "]", ",")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 40}, "minItems": 2,
     "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
     "none": {"type": "null"}}, "required": ["color", "ok", "none"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
     "day": {"type": "string", "format": "date"}}, "required": ["id", "day"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^[A-Z]{2}\d{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "number", "exclusiveMinimum": 0},
     {"type": "string", "minLength": 2, "maxLength": 4}]}}, "required": ["v"], "additionalProperties": False},
    {"$defs": {"node": {"type": "object", "properties": {"k": {"const": "leaf"},
     "n": {"type": "integer", "multipleOf": 5}}, "required": ["k", "n"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/node"}, "b": {"type": "array",
     "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer"}],
     "items": False},
    # oneOf: a walk that matched two alternatives would fail validation (exactly one must match).
    {"type": "array", "items": {"oneOf": [{"type": "integer", "maximum": 9},
     {"type": "string", "maxLength": 2}, {"type": "null"}]}, "minItems": 1, "maxItems": 3},
    # A discriminated union as pydantic writes it: $refs, open objects, a const tag.
    {"$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "n": {"type": "integer"}},
     "required": ["kind", "n"]}, "dog": {"type": "object", "properties": {"kind": {"const": "dog"},
     "ok": {"type": "boolean"}}, "required": ["kind", "ok"]}}, "oneOf": [{"$ref": "#/$defs/cat"},
     {"$ref": "#/$defs/dog"}], "discriminator": {"propertyName": "kind"}},
]  # fmt: skip
REGEXES = [
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,5}@[a-z]{3}\.(com|org)",
    r"v\d+\.\d+\.\d+",
    r"[\w]{1,6}",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info("smollm2-135m-instruct").tokenizer.hf_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@functools.cache
def closing_ids(tokenizer) -> frozenset[int]:
    return closing_token_ids(tokenizer, CLOSERS)


def random_walk(compiler, tokenizer, spec, seed) -> tuple[list[int], bool]:
    """Random allowed tokens, closing ones preferred after 40: the ids and whether EOS came."""
    return grammar_walks.random_walk(
        compiler,
        spec,
        eos_token_id=tokenizer.eos_token_id,
        closing_ids=closing_ids(tokenizer),
        seed=seed,
        max_tokens=MAX_TOKENS,
        prefer_closing_after=40,
    )


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_through_a_schemas_grammar_end_in_valid_json(compiler, tokenizer, index):
    schema = SCHEMAS[index]
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    finished = 0
    for seed in range(8):
        ids, ended = random_walk(compiler, tokenizer, GrammarSpec.json_schema(schema), seed)
        if ended:
            finished += 1
            checker.validate(json.loads(tokenizer.decode(ids)))
    assert finished >= 6


@pytest.mark.parametrize("pattern", REGEXES)
def test_random_walks_through_a_regex_end_in_a_full_match_with_ascii_classes(compiler, tokenizer, pattern):
    finished = 0
    for seed in range(8):
        ids, ended = random_walk(compiler, tokenizer, GrammarSpec.regex(pattern), seed)
        if ended:
            finished += 1
            text = tokenizer.decode(ids)
            # ECMA-262 classes: \d is [0-9] (llguidance's own \d takes any Unicode digit)
            assert re.fullmatch(pattern, text, re.ASCII), text
    assert finished >= 6


def test_a_token_crossing_a_grammar_boundary_is_allowed_exactly_when_its_text_fits(compiler, tokenizer):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    close = tokenizer.convert_tokens_to_ids('"}')
    assert tokenizer.decode([close]) == '"}', "SmolLM2 has a token for the two characters"
    matcher = compiler.compile(GrammarSpec.json_schema(schema)).matcher()
    bitmask = compiler.allocate_bitmask(1)
    for token in tokenizer.encode('{"a":"x', add_special_tokens=False):
        assert matcher.advance(token)
    matcher.fill_bitmask(bitmask, 0)
    assert close in allowed_ids(bitmask[0], compiler.vocab_size)
    assert matcher.advance(close) and matcher.is_terminal
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask[0], compiler.vocab_size) == [tokenizer.eos_token_id]


def test_a_forbidden_token_is_refused_and_leaves_the_matcher_dead(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.regex("(yes|no)")).matcher()
    (x_token,) = tokenizer.encode("x", add_special_tokens=False)
    assert not matcher.advance(x_token) and matcher.is_dead


def test_a_rolled_back_matcher_is_where_a_fresh_one_over_the_kept_tokens_is(compiler, tokenizer):
    # Speculative decoding rejects draft tokens: the matcher must forget exactly those.
    spec = GrammarSpec.json_schema(SCHEMAS[3])
    ids, ended = random_walk(compiler, tokenizer, spec, seed=1)
    assert ended and len(ids) > 6
    bitmask, fresh_bitmask = compiler.allocate_bitmask(1), compiler.allocate_bitmask(1)
    matcher = compiler.compile(spec).matcher()
    for token in ids:
        assert matcher.advance(token)
    assert matcher.is_terminal
    position = len(ids)
    for kept in (len(ids) - 1, len(ids) - 4, 2):
        matcher.rollback(position - kept)
        position = kept
        fresh = compiler.compile(spec).matcher()
        for token in ids[:kept]:
            assert fresh.advance(token)
        matcher.fill_bitmask(bitmask, 0)
        fresh.fill_bitmask(fresh_bitmask, 0)
        assert torch.equal(bitmask, fresh_bitmask) and not matcher.is_terminal
    # And it goes on from there to the same end.
    for token in ids[2:]:
        assert matcher.advance(token)
    assert matcher.is_terminal


def test_properties_are_written_in_the_schemas_order(compiler, tokenizer):
    properties = {"zeta": {"const": 1}, "alpha": {"const": 2}, "mid": {"const": 3}}
    schema = {"type": "object", "properties": properties, "required": list(properties),
              "additionalProperties": False}  # fmt: skip
    ids, ended = random_walk(compiler, tokenizer, GrammarSpec.json_schema(schema), seed=0)
    assert ended and tokenizer.decode(ids) == '{"zeta":1,"alpha":2,"mid":3}'


def test_a_spec_compiles_once(compiler):
    # Two requests' equal schemas (separate objects, as two requests parse them) share one grammar.
    a = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert compiler.compile(a) is compiler.compile(b)


def test_a_pattern_the_library_cannot_compile_is_a_spec_error_when_built_and_when_compiled(compiler):
    with pytest.raises(GrammarSpecError, match="cannot be enforced"):
        GrammarSpec.regex(r"a(?=b)")  # lookahead: Python's re has it, no automaton does
    with pytest.raises(GrammarSpecError, match="cannot be enforced"):
        compiler.compile(GrammarSpec("regex", r"a(?=b)"))  # built without the check


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [(r"\d{3}", "[0-9]{3}"), (r"[\d.]+", "[0-9.]+"), (r"\\d", r"\\d"), (r"\w+\s", "[A-Za-z0-9_]+\\s"),
     (r"[\]\d]", r"[\]0-9]")],
)  # fmt: skip
def test_ascii_classes_spell_d_and_w_as_ecma_does(pattern, ascii):
    assert ascii_classes(pattern) == ascii


# -- what clients send as vLLM's structured output: choices, Lark and GBNF grammars -----------------


def test_a_walk_through_a_choice_list_ends_in_one_of_the_strings(compiler, tokenizer):
    options = ["red", "dark blue", 'say "hi"', "grün", "back\\slash", ""]
    texts = set()
    for seed in range(12):
        ids, ended = random_walk(compiler, tokenizer, GrammarSpec.choice(options), seed)
        assert ended
        texts.add(tokenizer.decode(ids))
    assert texts <= set(options) and len(texts) >= 2, texts


# The same language as GBNF (vLLM's documented EBNF) and as Lark; the oracle is Python's re.
SQL = r"SELECT (id|name) FROM (users|orders) WHERE (id|name) = [0-9]{1,4}"
SQL_GRAMMARS = {
    "gbnf": 'root ::= "SELECT " col " FROM " table " WHERE " col " = " num\ncol ::= "id" | "name"\n'
    'table ::= "users" | "orders"\nnum ::= [0-9]{1,4}\n',
    "lark": 'start: "SELECT " col " FROM " table " WHERE " col " = " NUM\ncol: "id" | "name"\n'
    'table: "users" | "orders"\nNUM: /[0-9]{1,4}/\n',
}


@pytest.mark.parametrize("dialect", SQL_GRAMMARS)
def test_a_walk_through_a_grammar_in_either_dialect_matches_its_language(compiler, tokenizer, dialect):
    spec = GrammarSpec.cfg(SQL_GRAMMARS[dialect])
    for seed in range(4):
        ids, ended = random_walk(compiler, tokenizer, spec, seed)
        assert ended and re.fullmatch(SQL, tokenizer.decode(ids)), tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda: GrammarSpec.cfg("start: missing"), "unknown name"),
        (lambda: GrammarSpec.cfg("root ::= (("), "gbnf"),
        (lambda: GrammarSpec.cfg('start: a\na: a "x"'), "no output matches"),
        (lambda: GrammarSpec.regex("[^\\x00-\\U0010FFFF]"), "no output matches"),
        (lambda: GrammarSpec.regex("a(?=b)"), "look-around"),
        (lambda: GrammarSpec.choice([]), "non-empty"),
    ],
    ids=["unknown-rule", "gbnf-garbage", "rule-never-ends", "empty-regex", "lookahead", "no-choices"],
)
def test_what_no_output_can_match_or_llguidance_cannot_build_is_refused_with_its_reason(build, says):
    with pytest.raises(GrammarSpecError) as raised:
        build()
    assert says in str(raised.value).lower(), raised.value
