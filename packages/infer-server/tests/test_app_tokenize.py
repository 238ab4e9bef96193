"""POST /tokenize and POST /detokenize on a real server (infer.server.routes_tokenize), checked
against transformers' own tokenizer on the same folder (encode, the official chat template,
convert_ids_to_tokens, decode), the chat route's usage.prompt_tokens, and the rules of
infer.server.errors for every refusal: a 4xx naming the field, the server still serving after."""

import httpx
import pytest

from .test_app_errors import HI, assert_refused_and_still_serving, post, refusal

TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Colour of the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TEXTS = ["Hello, world.", "naïve café, 東京, 🙂", "  two  spaces\nand a line", ""]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_loaded):
    """transformers' tokenizer on the served folder: the oracle."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_loaded.path)


@pytest.mark.parametrize("add_special_tokens", [None, True, False], ids=["default", "true", "false"])
@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "non-ascii", "whitespace", "empty"])
def test_tokenize_a_prompt_as_transformers_encodes_it(server, hf_tokenizer, text, add_special_tokens):
    body = {"model": server.model, "prompt": text}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    response = post(server, TOKENIZE, json=body)
    assert response.status_code == 200, response.text
    expected = hf_tokenizer(text, add_special_tokens=add_special_tokens is not False)["input_ids"]
    models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert response.json() == {
        "count": len(expected),
        "max_model_len": models[0]["max_model_len"],
        "tokens": expected,
        "token_strs": None,
    }


def test_token_strs_are_the_vocabulary_entries(server, hf_tokenizer):
    text = "naïve café, 東京"
    response = post(server, TOKENIZE, json={"prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == hf_tokenizer(text)["input_ids"]
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [HI, CONVERSATION], ids=["hi", "conversation"])
def test_tokenize_messages_as_the_official_chat_template(
    server, hf_tokenizer, messages, add_generation_prompt
):
    response = post(
        server,
        TOKENIZE,
        json={"model": server.model, "messages": messages, "add_generation_prompt": add_generation_prompt},
    )
    assert response.status_code == 200, response.text
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert response.json()["tokens"] == list(expected)
    assert response.json()["count"] == len(expected)


@pytest.mark.parametrize(
    "chat",
    [
        {"messages": CONVERSATION},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}
            ]
        },
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]},
        {"messages": HI, "chat_template_kwargs": {"default_system_prompt": "Be brief."}},
    ],
    ids=["conversation", "text-parts", "tools", "template-kwargs"],
)
def test_tokenize_messages_counts_the_chat_routes_prompt_tokens(server, chat):
    tokenized = post(server, TOKENIZE, json={"model": server.model, **chat})
    answered = post(
        server,
        "/v1/chat/completions",
        json={"model": server.model, **chat, "max_tokens": 1, "temperature": 0},
    )
    assert tokenized.status_code == answered.status_code == 200, (tokenized.text, answered.text)
    assert tokenized.json()["count"] == answered.json()["usage"]["prompt_tokens"]


def test_tools_change_the_tokenized_chat(server):
    """The tools reach the template (the prompt lists them), as on the chat route."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = post(server, TOKENIZE, json={"messages": messages}).json()
    with_tools = post(server, TOKENIZE, json={"messages": messages, "tools": [WEATHER_TOOL]}).json()
    assert with_tools["count"] > plain["count"]
    text = post(server, DETOKENIZE, json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert "get_weather" in text


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "non-ascii", "whitespace", "empty"])
def test_detokenize_as_transformers_decodes(server, hf_tokenizer, text):
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    response = post(server, DETOKENIZE, json={"model": server.model, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": hf_tokenizer.decode(ids)}
    assert response.json()["prompt"] == text  # byte-level BPE gives every text back


def test_detokenize_writes_special_tokens_out(server, hf_tokenizer):
    ids = list(hf_tokenizer.apply_chat_template(HI, add_generation_prompt=True, return_dict=False))
    response = post(server, DETOKENIZE, json={"tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json()["prompt"] == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in response.json()["prompt"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (TOKENIZE, {"model": None, "prompt": "Hi", "add_special_tokens": None, "return_token_strs": None}),
        (
            TOKENIZE,
            {
                "model": None,
                "messages": HI,
                "add_special_tokens": None,
                "return_token_strs": None,
                "add_generation_prompt": None,
                "continue_final_message": None,
                "chat_template": None,
                "chat_template_kwargs": None,
                "mm_processor_kwargs": None,
                "tools": None,
            },
        ),
        (TOKENIZE, {"prompt": "Hi", "messages": None}),
        (
            TOKENIZE,
            {"messages": HI, "prompt": None, "continue_final_message": False, "mm_processor_kwargs": {}},
        ),
        (DETOKENIZE, {"model": None, "tokens": [1, 2]}),
    ],
    ids=["prompt", "messages", "prompt-with-null-messages", "messages-neutral-values", "detokenize"],
)
def test_null_and_neutral_values_of_optional_fields_are_accepted(server, path, body):
    response = post(server, path, json=body)
    assert response.status_code == 200, response.text


VOCAB_SIZE = 49152  # SmolLM2's: ids 0 .. 49151
REFUSALS = [
    refusal(TOKENIZE, b"{not json", 400, "invalid_json", None),
    refusal(TOKENIZE, b"[1, 2]", 400, "invalid_body", None),
    refusal(TOKENIZE, {"model": "$MODEL"}, 400, "missing_required_parameter", "prompt"),
    refusal(TOKENIZE, {"prompt": None, "messages": None}, 400, "missing_required_parameter", "prompt"),
    refusal(TOKENIZE, {"prompt": "Hi", "messages": HI}, 400, "invalid_value", "messages"),
    refusal(TOKENIZE, {"prompt": 5}, 400, "invalid_value", "prompt"),
    refusal(TOKENIZE, {"prompt": ["Hi"]}, 400, "invalid_value", "prompt"),
    refusal(TOKENIZE, {"messages": "Hi"}, 400, "invalid_value", "messages"),
    refusal(TOKENIZE, {"messages": []}, 400, "empty_input", "messages"),
    refusal(
        TOKENIZE, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "invalid_value", "messages.0.role"
    ),
    refusal(
        TOKENIZE, {"prompt": "Hi", "add_special_tokens": "yes"}, 400, "invalid_value", "add_special_tokens"
    ),
    refusal(TOKENIZE, {"prompt": "Hi", "return_token_strs": 1}, 400, "invalid_value", "return_token_strs"),
    refusal(TOKENIZE, {"prompt": "Hi", "add_bos": True}, 400, "unknown_parameter", "add_bos"),
    refusal(TOKENIZE, {"prompt": "Hi", "model": 5}, 400, "invalid_value", "model"),
    refusal(TOKENIZE, {"prompt": "Hi", "model": "no-such-model"}, 404, "model_not_found", "model"),
    refusal(
        TOKENIZE,
        {"prompt": "Hi", "add_generation_prompt": True},
        400,
        "invalid_value",
        "add_generation_prompt",
    ),
    refusal(TOKENIZE, {"prompt": "Hi", "tools": [WEATHER_TOOL]}, 400, "invalid_value", "tools"),
    refusal(
        TOKENIZE,
        {"messages": HI, "continue_final_message": True, "add_generation_prompt": False},
        400,
        "unsupported_value",
        "continue_final_message",
    ),
    refusal(
        TOKENIZE,
        {"messages": HI, "chat_template": "{{ messages }}"},
        400,
        "unsupported_value",
        "chat_template",
    ),
    refusal(
        TOKENIZE,
        {"messages": HI, "mm_processor_kwargs": {"a": 1}},
        400,
        "unsupported_value",
        "mm_processor_kwargs",
    ),
    refusal(
        TOKENIZE,
        {"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}},
        400,
        "invalid_value",
        "chat_template_kwargs",
    ),
    refusal(
        TOKENIZE, {"messages": HI, "chat_template_kwargs": [1]}, 400, "invalid_value", "chat_template_kwargs"
    ),
    refusal(
        TOKENIZE,
        {
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        },
        400,
        "invalid_value",
        "tools.0.function.parameters",
    ),
    refusal(
        TOKENIZE,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        400,
        "unsupported_value",
        "messages.0.content.1.image_url.url",
    ),
    refusal(DETOKENIZE, b"{tokens: [1", 400, "invalid_json", None),
    refusal(DETOKENIZE, {"model": "$MODEL"}, 400, "missing_required_parameter", "tokens"),
    refusal(DETOKENIZE, {"tokens": None}, 400, "missing_required_parameter", "tokens"),
    refusal(DETOKENIZE, {"tokens": "1 2"}, 400, "invalid_value", "tokens"),
    refusal(DETOKENIZE, {"tokens": [1, -1]}, 400, "invalid_value", "tokens.1"),
    refusal(DETOKENIZE, {"tokens": [1, 1.5]}, 400, "invalid_value", "tokens.1"),
    refusal(DETOKENIZE, {"tokens": [True]}, 400, "invalid_value", "tokens.0"),
    refusal(DETOKENIZE, {"tokens": [1, 2, VOCAB_SIZE]}, 400, "invalid_value", "tokens.2"),
    refusal(DETOKENIZE, {"tokens": [10**12]}, 400, "invalid_value", "tokens.0"),
    refusal(DETOKENIZE, {"tokens": [2**70]}, 400, "invalid_value", "tokens.0"),
    refusal(DETOKENIZE, {"tokens": [1], "model": "no-such-model"}, 404, "model_not_found", "model"),
    refusal(
        DETOKENIZE,
        {"tokens": [1], "skip_special_tokens": True},
        400,
        "unknown_parameter",
        "skip_special_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), REFUSALS)
def test_malformed_input_is_a_4xx_naming_the_field(server, path, body, status, code, param):
    assert_refused_and_still_serving(
        server, path, body, status, code, param, still=(TOKENIZE, {"prompt": "Hi"})
    )


def test_a_prompt_at_the_character_limit_is_tokenized_and_one_over_is_413(small_limits_server):
    server = small_limits_server
    at_limit = post(server, TOKENIZE, json={"prompt": "a" * 100})
    assert at_limit.status_code == 200, at_limit.text
    for body, param in (
        ({"prompt": "a" * 101}, "prompt"),
        # The rendered conversation is what counts: the template's own text is over 100 characters.
        ({"messages": HI}, "messages"),
    ):
        response = post(server, TOKENIZE, json=body)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("prompt_too_large", param)
        assert "(100, --max-prompt-chars)" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [(TOKENIZE, {"prompt": "x" * 3000}), (DETOKENIZE, {"tokens": [1] * 1000})],
    ids=["tokenize", "detokenize"],
)
def test_a_body_over_the_byte_limit_is_413(small_limits_server, path, body):
    response = post(small_limits_server, path, json=body)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert post(small_limits_server, DETOKENIZE, json={"tokens": [1] * 10}).status_code == 200


# -- a tokenizer that adds a BOS: Gemma 3's (SmolLM2's adds no special token) -------------------

GEMMA = "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma_server():
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.server.serve import BackgroundServer

    engine = Engine(EngineConfig(model=GEMMA, max_seq_len=256, max_batch_size=1))
    running = BackgroundServer(engine, served_model_name=GEMMA, log_level="warning")
    running.tokenizer_folder = engine.model_info.path
    yield running
    running.stop()


@pytest.fixture(scope="module")
def gemma_hf_tokenizer(gemma_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_server.tokenizer_folder)


def test_a_prompt_gets_the_bos_unless_add_special_tokens_is_false(gemma_server, gemma_hf_tokenizer):
    text = "Hello, world."
    default = post(gemma_server, TOKENIZE, json={"model": GEMMA, "prompt": text}).json()
    without = post(gemma_server, TOKENIZE, json={"prompt": text, "add_special_tokens": False}).json()
    assert default["tokens"] == gemma_hf_tokenizer(text)["input_ids"]
    assert default["tokens"][0] == gemma_hf_tokenizer.bos_token_id
    assert without["tokens"] == gemma_hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert without["tokens"] == default["tokens"][1:]


def test_a_chat_has_the_templates_bos_once_unless_add_special_tokens_adds_one(
    gemma_server, gemma_hf_tokenizer
):
    bos = gemma_hf_tokenizer.bos_token_id
    default = post(gemma_server, TOKENIZE, json={"messages": CONVERSATION}).json()
    rendered = post(gemma_server, DETOKENIZE, json={"tokens": default["tokens"]}).json()["prompt"]
    assert rendered.startswith("<bos><start_of_turn>user\n")  # the template writes its BOS
    assert default["tokens"] == gemma_hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert default["tokens"].count(bos) == 1
    # vLLM's add_special_tokens on a chat: the tokenizer's own on top of the template's.
    doubled = post(gemma_server, TOKENIZE, json={"messages": CONVERSATION, "add_special_tokens": True}).json()
    assert doubled["tokens"] == gemma_hf_tokenizer(rendered, add_special_tokens=True)["input_ids"]
    assert doubled["tokens"] == [bos, *default["tokens"]]


def test_a_gemma_chat_counts_the_chat_routes_prompt_tokens(gemma_server):
    tokenized = post(gemma_server, TOKENIZE, json={"messages": CONVERSATION})
    answered = post(
        gemma_server,
        "/v1/chat/completions",
        json={"model": GEMMA, "messages": CONVERSATION, "max_tokens": 1, "temperature": 0},
    )
    assert tokenized.status_code == answered.status_code == 200, (tokenized.text, answered.text)
    assert tokenized.json()["count"] == answered.json()["usage"]["prompt_tokens"]
