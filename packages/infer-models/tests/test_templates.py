"""Our chat templates against the official ones.

Oracles: SmolLM2's template as shipped in its GGUF (from the fetched folder), rendered with a
plain jinja2 Environment; the official Llama 3.2, Qwen 3 and Gemma 3 templates kept under
tests/data/chat_templates (sources in SOURCES.md), rendered by transformers' renderer.
"""

import copy
import json
from pathlib import Path

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from infer.models.chat_template import (
    TEMPLATES_DIR,
    ChatTemplateError,
    ChatTemplateKwargsError,
    chat_template_families,
    chat_template_for,
    detect_family,
    read_tokenizer_config,
)
from infer.models.loader.fetch import fetch_model
from infer.models.loader.tokenizer import Tokenizer

ORACLES = Path(__file__).parent / "data" / "chat_templates"
DATE = "21 Nov 2026"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <with> 'quotes' & ünïcode",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
PARIS_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
}

SINGLE_TURN = [{"role": "user", "content": "What is 2 + 2?"}]
WITH_SYSTEM = [
    {"role": "system", "content": "You are terse.  "},
    {"role": "user", "content": "  Hi there\n"},
    {"role": "assistant", "content": "Hello! 👋"},
    {"role": "user", "content": "Translate 'cat' to 中文."},
]
MULTI_TURN = [
    {"role": "user", "content": "One"},
    {"role": "assistant", "content": "Two"},
    {"role": "user", "content": "Three"},
    {"role": "assistant", "content": "Four"},
]
PLAIN_CONVERSATIONS = {"single": SINGLE_TURN, "system": WITH_SYSTEM, "multi": MULTI_TURN}


def _official(name: str, messages, **kwargs) -> str:
    template = (ORACLES / name).read_text()
    rendered, _ = render_jinja_template(
        conversations=[copy.deepcopy(messages)], chat_template=template, **kwargs
    )
    return rendered[0]


# --- chatml: SmolLM2's own template ----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_template() -> jinja2.Template:
    shipped = read_tokenizer_config(fetch_model("smollm2-135m-instruct"))["chat_template"]
    return jinja2.Environment().from_string(shipped)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", [*PLAIN_CONVERSATIONS, "tool_result"])
def test_chatml_renders_like_smollm2s_shipped_template(smollm2_template, name, add_generation_prompt):
    messages = PLAIN_CONVERSATIONS.get(name) or [
        {"role": "user", "content": "Weather?"},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    ours = chat_template_for("chatml").render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == smollm2_template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_chatml_adds_smollm2s_default_system_prompt():
    rendered = chat_template_for("chatml").render(SINGLE_TURN)
    assert rendered.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    )
    assert rendered.endswith("<|im_start|>assistant\n")


# An OpenAI-style tool round trip: the call's arguments are a JSON string on the wire.
OPENAI_TOOL_ROUND_TRIP = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def _with_object_arguments(messages):
    # What the official templates expect: arguments as a mapping, content "" beside tool calls.
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message.get("tool_calls"):
            message["content"] = ""
    return messages


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_tools_render_exactly_like_qwens_hermes_format(add_generation_prompt):
    # Qwen 3's official template without thinking content is the Hermes format we add to ChatML.
    ours = chat_template_for("chatml").render(
        OPENAI_TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], add_generation_prompt=add_generation_prompt
    )
    official = _official(
        "qwen3-0.6b.jinja",
        _with_object_arguments(OPENAI_TOOL_ROUND_TRIP),
        tools=[WEATHER_TOOL],
        add_generation_prompt=add_generation_prompt,
    )
    assert ours == official
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        in ours
    )
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>" in ours


def test_chatml_tools_without_a_system_message_follow_smollm2s_default_prompt():
    rendered = chat_template_for("chatml").render(SINGLE_TURN, tools=[WEATHER_TOOL])
    assert rendered.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
        "# Tools\n"
    )
    assert rendered.count("<|im_start|>system") == 1
    assert "\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in rendered
    assert rendered.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


# --- llama3: Meta's Llama 3.2 template --------------------------------------------------------

LLAMA_TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
    {"role": "tool", "content": {"temperature": 21, "sky": "clear"}},
    {"role": "tool", "content": "21 C and clear"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(PLAIN_CONVERSATIONS))
def test_llama3_renders_like_metas_template(name, add_generation_prompt):
    messages = PLAIN_CONVERSATIONS[name]
    ours = chat_template_for("llama3").render(
        messages, add_generation_prompt=add_generation_prompt, date_string=DATE
    )
    official = _official(
        "llama-3.2-3b-instruct.jinja",
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|begin_of_text|>",
        date_string=DATE,
    )
    assert ours == official


@pytest.mark.parametrize("tools_in_user_message", [True, False])
def test_llama3_tools_render_like_metas_json_function_calling(tools_in_user_message):
    # Meta's template reads `'tool_calls' in message`; our normalization gives the assistant
    # message the empty content the official template would also have rendered around.
    official_messages = copy.deepcopy(LLAMA_TOOL_CONVERSATION)
    official_messages[2]["content"] = ""
    kwargs = {"date_string": DATE, "tools_in_user_message": tools_in_user_message}
    ours = chat_template_for("llama3").render(LLAMA_TOOL_CONVERSATION, tools=[WEATHER_TOOL], **kwargs)
    official = _official(
        "llama-3.2-3b-instruct.jinja",
        official_messages,
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        **kwargs,
    )
    assert ours == official
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}<|eot_id|>' in ours


def test_llama3_accepts_openai_style_string_arguments_without_quoting_them_twice():
    as_string = copy.deepcopy(LLAMA_TOOL_CONVERSATION)
    as_string[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris", "unit": "c"}'
    template = chat_template_for("llama3")
    assert template.render(as_string, tools=[WEATHER_TOOL], date_string=DATE) == template.render(
        LLAMA_TOOL_CONVERSATION, tools=[WEATHER_TOOL], date_string=DATE
    )


# --- qwen3: Qwen's template, thinking on and off ------------------------------------------

QWEN_AGENT_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "<think>\nTwo cities, two calls.\n</think>\n\nLet me check.",
        "tool_calls": [
            PARIS_CALL,
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "content": "Paris: 21 C"},
    {"role": "tool", "content": "Rome: 25 C"},
]
QWEN_HISTORY_WITH_REASONING = [
    {"role": "user", "content": "First question"},
    {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nFirst answer"},
    {"role": "user", "content": "Second question"},
    {"role": "assistant", "content": "Second answer", "reasoning_content": "recent reasoning"},
]
QWEN_CONVERSATIONS = {
    **PLAIN_CONVERSATIONS,
    "agent": QWEN_AGENT_CONVERSATION,
    "history_reasoning": QWEN_HISTORY_WITH_REASONING,
}


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(QWEN_CONVERSATIONS))
def test_qwen3_renders_like_qwens_template(name, add_generation_prompt, enable_thinking):
    messages = QWEN_CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "agent" else None
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = chat_template_for("qwen3").render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
    )
    official = _official(
        "qwen3-0.6b.jinja", messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
    )
    assert ours == official


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_tool_round_trip_with_openai_string_arguments_renders_like_qwens_template(enable_thinking):
    ours = chat_template_for("qwen3").render(
        OPENAI_TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], enable_thinking=enable_thinking
    )
    official = _official(
        "qwen3-0.6b.jinja",
        _with_object_arguments(OPENAI_TOOL_ROUND_TRIP),
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    assert ours == official


def test_llama3_tool_round_trip_with_openai_string_arguments_renders_like_metas_template():
    ours = chat_template_for("llama3").render(OPENAI_TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], date_string=DATE)
    official = _official(
        "llama-3.2-3b-instruct.jinja",
        _with_object_arguments(OPENAI_TOOL_ROUND_TRIP),
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        date_string=DATE,
    )
    assert ours == official
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"21 C"<|eot_id|>' in ours


def test_qwen3_without_thinking_ends_the_prompt_with_an_empty_think_block():
    template = chat_template_for("qwen3")
    assert template.render(SINGLE_TURN, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert template.render(SINGLE_TURN, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_qwen3_strips_reasoning_from_turns_before_the_last_query():
    rendered = chat_template_for("qwen3").render(QWEN_HISTORY_WITH_REASONING, add_generation_prompt=False)
    assert "old reasoning" not in rendered
    assert "<|im_start|>assistant\nFirst answer<|im_end|>" in rendered
    assert "<think>\nrecent reasoning\n</think>\n\nSecond answer" in rendered


# --- gemma3: Google's template -------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(PLAIN_CONVERSATIONS))
def test_gemma3_renders_like_googles_template(name, add_generation_prompt):
    messages = PLAIN_CONVERSATIONS[name]
    ours = chat_template_for("gemma3").render(messages, add_generation_prompt=add_generation_prompt)
    official = _official(
        "gemma-3-it.jinja", messages, add_generation_prompt=add_generation_prompt, bos_token="<bos>"
    )
    assert ours == official


# Google's tool_code prompt for Gemma (the "function calling with Gemma" guide): instructions,
# then the tools as Python functions, then the user's request; calls and results as code blocks.
GEMMA_TOOL_INSTRUCTIONS = (
    "At each turn, if you decide to invoke any of the function(s), it should be wrapped with "
    "```tool_code```. "
    "The python methods described below are imported and available, you can only use defined methods. "
    "The generated code should be readable and efficient. The response to a method will be wrapped in "
    "```tool_output``` use it to call more tools or generate a helpful, friendly response. "
    "When using a ```tool_call``` think step by step why and how it should be used.\n\n"
    "The following Python methods are available:\n\n"
)


def test_gemma3_tool_round_trip_renders_googles_tool_code_format():
    rendered = chat_template_for("gemma3").render(OPENAI_TOOL_ROUND_TRIP, tools=[WEATHER_TOOL])
    assert rendered == (
        "<bos><start_of_turn>user\nYou are a weather bot.\n\n"
        + GEMMA_TOOL_INSTRUCTIONS
        + "```python\n"
        + "def get_weather(city: str, unit: Any = None):\n"
        + '    """Current weather in a city <with> \'quotes\' & ünïcode\n\n'
        + '    Args:\n      city: str\n      unit: Any\n    """\n'
        + "```\n\n"
        + "Weather in Paris?<end_of_turn>\n"
        + '<start_of_turn>model\n```tool_code\nget_weather(city="Paris", unit="c")\n```<end_of_turn>\n'
        + "<start_of_turn>user\n```tool_output\n21 C\n```<end_of_turn>\n"
        + "<start_of_turn>model\n"
    )


def test_gemma3_consecutive_tool_results_share_one_user_turn_and_turns_still_alternate():
    two_results = OPENAI_TOOL_ROUND_TRIP + [{"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    rendered = chat_template_for("gemma3").render(two_results, tools=[WEATHER_TOOL])
    assert rendered.endswith(
        "<start_of_turn>user\n```tool_output\n21 C\n```\n```tool_output\nsunny\n```<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="alternate"):
        chat_template_for("gemma3").render(two_results + [{"role": "user", "content": "and?"}] * 2)


def test_gemma3_signature_puts_required_arguments_first_with_python_types():
    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "nights": {"type": "integer", "description": "How many nights"},
                    "hotel": {"type": "string"},
                    "price": {"type": ["number", "null"]},
                },
                "required": ["hotel"],
            },
        },
    }
    rendered = chat_template_for("gemma3").render(SINGLE_TURN, tools=[tool])
    assert "def book(hotel: str, nights: int = None, price: Any = None):\n" in rendered
    assert "      nights: How many nights\n" in rendered


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn():
    rendered = chat_template_for("gemma3").render(WITH_SYSTEM[:2])
    assert (
        rendered
        == "<bos><start_of_turn>user\nYou are terse.  \n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    )


# Images as Hugging Face's processors take them: {"type": "image"} parts among text parts.
WITH_IMAGES = [
    {"role": "system", "content": "You see pictures."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": " Compare "},
            {"type": "image"},
            {"type": "text", "text": "with"},
            {"type": "image"},
        ],
    },
    {"role": "assistant", "content": "The first is darker."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?\n"}]},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma3_writes_googles_image_marker_for_each_image_part(add_generation_prompt):
    ours = chat_template_for("gemma3").render(WITH_IMAGES, add_generation_prompt=add_generation_prompt)
    official = _official(
        "gemma-3-it.jinja", WITH_IMAGES, add_generation_prompt=add_generation_prompt, bos_token="<bos>"
    )
    assert ours == official
    assert ours.count("<start_of_image>") == 3


QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_writes_qwen_vl_image_marker_for_each_image_part(add_generation_prompt):
    """Qwen3-VL's template is Qwen 3's with each image part written as the vision run (its
    processor's placeholder, widened per image): the official Qwen 3 template over the same
    messages with each image part spelled so gives the same prompt."""
    ours = chat_template_for("qwen3").render(WITH_IMAGES, add_generation_prompt=add_generation_prompt)
    spelled = [
        {
            **message,
            "content": "".join(
                QWEN_VL_IMAGE if p["type"] == "image" else p["text"] for p in message["content"]
            ),
        }
        if isinstance(message["content"], list)
        else message
        for message in WITH_IMAGES
    ]
    official = _official("qwen3-0.6b.jinja", spelled, add_generation_prompt=add_generation_prompt)
    assert ours == official
    assert ours.count(QWEN_VL_IMAGE) == 3


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_a_template_without_images_refuses_an_image_part(family):
    with pytest.raises(ChatTemplateError, match="takes no images"):
        chat_template_for(family).render(WITH_IMAGES[1:2])


def test_gemma3_rejects_turns_that_do_not_alternate():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        chat_template_for("gemma3").render(messages)


# --- the templates and the real tokenizers --------------------------------------------------


@pytest.mark.parametrize(
    ("family", "alias"), [("chatml", "smollm2-135m-instruct"), ("gemma3", "gemma-3-270m")]
)
def test_control_tokens_of_a_rendered_prompt_encode_as_single_special_tokens(family, alias):
    tokenizer = Tokenizer(fetch_model(alias))
    template = chat_template_for(family)
    ids = tokenizer.encode(template.render(WITH_SYSTEM), add_special_tokens=False)
    end_of_turn_id = tokenizer.token_id(template.end_of_turn_token)
    assert end_of_turn_id is not None
    assert ids.count(end_of_turn_id) == template.render(WITH_SYSTEM).count(template.end_of_turn_token)
    if family == "gemma3":
        assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id


# --- choosing and loading templates ---------------------------------------------------------


def test_every_family_has_a_template_and_an_end_of_turn_token():
    assert chat_template_families() == ["chatml", "gemma3", "llama3", "qwen3"]
    for family in chat_template_families():
        template = chat_template_for(family)
        assert template.family == family
        assert template.end_of_turn_token in template.render(
            SINGLE_TURN + [{"role": "assistant", "content": "4"}]
        )


def test_an_unknown_family_names_the_templates_folder_and_its_families():
    with pytest.raises(ValueError) as excinfo:
        chat_template_for("mistral")
    message = str(excinfo.value)
    assert str(TEMPLATES_DIR) in message
    assert all(family in message for family in ("chatml", "gemma3", "llama3", "qwen3"))


def test_detect_family_reads_the_checkpoints_own_template():
    smollm2_config = read_tokenizer_config(fetch_model("smollm2-135m-instruct"))
    assert detect_family(smollm2_config, "llama") == "chatml"
    llama_config = {"chat_template": (ORACLES / "llama-3.2-3b-instruct.jinja").read_text()}
    assert detect_family(llama_config, "llama") == "llama3"
    assert detect_family({}, "llama") == "llama3"
    assert detect_family({}, "qwen3") == "qwen3"
    assert detect_family(read_tokenizer_config(fetch_model("gemma-3-270m")), "gemma3_text") == "gemma3"
    with pytest.raises(ValueError, match="mistral"):
        detect_family({}, "mistral")


def test_image_content_parts_are_refused_with_the_part_type():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        chat_template_for("qwen3").render(messages)


def test_text_content_parts_render_like_the_joined_string():
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}],
        }
    ]
    template = chat_template_for("qwen3")
    assert template.render(parts) == template.render(SINGLE_TURN)


def test_template_variables_are_variables_even_when_named_like_render_parameters():
    template = chat_template_for("chatml")
    messages = [{"role": "user", "content": "Hi"}]
    assert template.render(messages, self=1) == template.render(messages)


def test_a_template_variable_of_the_wrong_type_is_a_kwargs_error_naming_it():
    template = chat_template_for("chatml")
    with pytest.raises(ChatTemplateKwargsError, match="default_system_prompt"):
        template.render([{"role": "user", "content": "Hi"}], default_system_prompt=5)
