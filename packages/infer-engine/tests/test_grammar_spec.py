"""GrammarSpec and the JSON Schema subset: what the official openai client sends for a pydantic
model passes; every keyword the engine does not enforce is refused by name, with where it is."""

import enum
import json
from typing import Literal

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from infer.engine.grammar_spec import (
    JSON_SCHEMA,
    REGEX,
    GrammarSpec,
    GrammarSpecError,
    check_json_schema,
)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    street: str = Field(min_length=1, max_length=80)
    zip: str | None = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    tags: list[str] = Field(min_length=1, max_length=4)
    address: Address
    friends: list["Person"]
    color: Color
    kind: Literal["a", "b"]
    score: float | None = None


def test_the_schema_the_openai_client_sends_for_a_pydantic_model_is_supported():
    # client.chat.completions.parse(response_format=Person) sends this (nested models as $defs,
    # a recursive $ref, Optional as anyOf with null, enums, bounds).
    schema = to_strict_json_schema(Person)
    spec = GrammarSpec.json_schema(schema)
    assert spec.kind == JSON_SCHEMA and json.loads(spec.source) == schema


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Cat | Dog = Field(discriminator="kind")
    nickname: str | int


@pytest.mark.parametrize("strict", [True, False])
def test_a_oneof_that_no_value_can_match_twice_is_supported(strict):
    # pydantic's discriminated union: oneOf of $refs, with a `discriminator` annotation.
    schema = to_strict_json_schema(Pet) if strict else Pet.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    assert GrammarSpec.json_schema(schema).kind == JSON_SCHEMA
    assert GrammarSpec.json_schema({"oneOf": [{"type": "string"}, {"type": "integer"}]}).kind == JSON_SCHEMA


def test_a_spec_keeps_the_schemas_key_order():
    # The output writes properties in the declared order, so another order is another grammar.
    a = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    b = {"type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
    assert list(json.loads(GrammarSpec.json_schema(a).source)["properties"]) == ["name", "age"]
    assert GrammarSpec.json_schema(a) != GrammarSpec.json_schema(b)
    assert GrammarSpec.json_schema(a) == GrammarSpec.json_schema(json.loads(json.dumps(a)))


@pytest.mark.parametrize(
    ("schema", "keyword", "path"),
    [
        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties", "patternProperties"),
        ({"allOf": [{"type": "string"}]}, "allOf", "allOf"),
        ({"not": {"type": "string"}}, "not", "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems", "uniqueItems"),
        ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf", "oneOf"),
        (
            # the first oneOf is fine; the second may match twice (an integer is a number)
            {
                "type": "object",
                "properties": {
                    "a": {"oneOf": [{"type": "string"}, {"type": "null"}]},
                    "b": {"items": {"oneOf": [{"type": "number"}, {"type": "integer"}]}},
                },
            },
            "oneOf",
            "properties.b.items.oneOf",
        ),
        ({"type": "number", "multipleOf": 0}, "multipleOf", "multipleOf"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if", "if"),
        (
            {"type": "object", "properties": {"tags": {"type": "array", "items": {"contains": {}}}}},
            "contains",
            "properties.tags.items.contains",
        ),
        ({"$defs": {"a": {"type": "string", "format": "hostname"}}}, "format", "$defs.a.format"),
        ({"type": "text"}, "type", "type"),
        ({"$ref": "https://example.com/schema.json"}, "$ref", "$ref"),
        ({"type": "array", "items": [{"type": "string"}]}, "items", "items"),
        ({"anyOf": []}, "anyOf", "anyOf"),
    ],
)
def test_a_keyword_the_engine_does_not_enforce_is_refused_by_name(schema, keyword, path):
    with pytest.raises(GrammarSpecError) as raised:
        GrammarSpec.json_schema(schema)
    assert raised.value.keyword == keyword and raised.value.path == path
    assert repr(keyword) in str(raised.value) or keyword in str(raised.value)


def test_annotations_change_nothing_and_pass():
    check_json_schema(
        {"title": "T", "description": "d", "examples": [1], "$schema": "x", "default": 1, "type": "integer"}
    )


def test_a_schema_nested_past_the_limit_is_refused():
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarSpecError, match="nests deeper"):
        check_json_schema(schema)


def test_a_regex_is_checked_when_built():
    assert GrammarSpec.regex(r"\d{3}-[a-z]+").kind == REGEX
    with pytest.raises(GrammarSpecError, match="does not compile"):
        GrammarSpec.regex("(unclosed")
    with pytest.raises(GrammarSpecError, match="non-empty"):
        GrammarSpec.regex("")
