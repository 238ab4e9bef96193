"""response_format on a real server through the official `openai` client and LangChain's
`with_structured_output`: answers parse and validate by pydantic (`chat.completions.parse`),
`jsonschema` and `re.fullmatch`, never by the grammar itself; streamed and not, chat and
completions; what cannot be enforced is a 400 that names it."""

import enum
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

QUESTION = [{"role": "user", "content": "Describe a cat as JSON."}]


class Colour(enum.Enum):
    BLACK = "black"
    WHITE = "white"
    GINGER = "ginger"


class Toy(BaseModel):
    name: str = Field(max_length=16)
    squeaks: bool


class Cat(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    age: int = Field(ge=0, le=30)
    colour: Colour
    toys: list[Toy] = Field(max_length=2)
    weight_kg: float | None


ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": r"^[A-Z]{3}-\d{4}$"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1,
                  "maxItems": 3},
        "express": {"type": "boolean"},
    },
    "required": ["id", "items", "express"],
    "additionalProperties": False,
}  # fmt: skip


def test_chat_completions_parse_returns_the_pydantic_model(server):
    completion = server.openai_client().chat.completions.parse(
        model=server.model, messages=QUESTION, response_format=Cat, temperature=0, max_tokens=200
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Cat), message.content  # pydantic validated it
    Cat.model_validate_json(message.content)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_pydantic_model(server, method):
    # json_schema sends response_format; function_calling sends the model as a tool and names it
    # in tool_choice, so the arguments are held to its schema by the forced call's grammar.
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=server.model, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_retries=0
    )
    cat = llm.with_structured_output(Cat, method=method).invoke(QUESTION[0]["content"])
    assert isinstance(cat, Cat), cat


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates_streamed_or_not(server, stream):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "order", "schema": ORDER, "strict": True},
    }
    client = server.openai_client()
    messages = [{"role": "user", "content": "Make up an order."}]
    if stream:
        chunks = client.chat.completions.create(
            model=server.model, messages=messages, response_format=response_format, stream=True,
            temperature=0.8, seed=7, max_tokens=120,
        )  # fmt: skip
        text, finish = "", None
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        answer = client.chat.completions.create(
            model=server.model, messages=messages, response_format=response_format, temperature=0.8, seed=7,
            max_tokens=120,
        )  # fmt: skip
        text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), ORDER)


def test_json_object_mode_answers_a_json_object(server):
    answer = server.openai_client().chat.completions.create(
        model=server.model,
        messages=QUESTION,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_regex(server, stream):
    pattern = r"\d{3}-\d{3}-\d{4}"
    kwargs = dict(
        model=server.model, prompt="Phone number: ", max_tokens=30, temperature=0.9, seed=3,
        extra_body={"response_format": {"type": "regex", "pattern": pattern}},
    )  # fmt: skip
    if stream:
        text = "".join(
            chunk.choices[0].text
            for chunk in server.openai_client().completions.create(stream=True, **kwargs)
        )
    else:
        text = server.openai_client().completions.create(**kwargs).choices[0].text
    assert re.fullmatch(pattern, text, re.ASCII), text


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        (_schema_format({"type": "array", "uniqueItems": True}), "uniqueItems"),
        # 5 matches both: a oneOf the grammar could only enforce as an anyOf
        (_schema_format({"oneOf": [{"type": "number"}, {"type": "integer"}]}), "oneOf"),
        ({"type": "regex", "pattern": "a(?=b)"}, "cannot be enforced"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(server, response_format, named):
    with pytest.raises(openai.BadRequestError) as raised:
        server.openai_client().chat.completions.create(
            model=server.model, messages=QUESTION, response_format=response_format, max_tokens=5
        )
    assert raised.value.status_code == 400 and named in raised.value.message
    assert raised.value.body["param"] == "response_format"
