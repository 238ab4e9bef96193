"""Chat prompts from messages, with our own Jinja templates (one per model family).

The templates live in `templates/<family>.jinja` and reproduce the official ones (SmolLM2's
ChatML, Meta's Llama 3.2, Qwen 3, Google's Gemma 3) for the conversations we serve; tests
compare them with the official templates rendered by an independent Jinja environment. Every
family takes `tools`: where the official template has no tool format we add the one its model
family is prompted with (ChatML: Qwen's Hermes format; Gemma 3: Google's tool_code prompt).
Rendered prompts carry their own BOS where the family wants one: encode them with
`add_special_tokens=False`.
"""

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from os import PathLike
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES_DIR = Path(__file__).parent / "templates"
END_OF_TURN_TOKENS = {
    "chatml": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "qwen3": "<|im_end|>",
    "gemma3": "<end_of_turn>",
}
# The families whose template takes a user message's image parts (`{"type": "image"}`, Hugging
# Face's form) and writes the model's image marker there (infer.models.vision.ImageLayout.marker).
IMAGE_FAMILIES = frozenset({"gemma3", "qwen3"})
_REASONING_ALIASES = ("reasoning", "thinking")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by this template (the message says which rule they break)."""


class ChatTemplateKwargsError(ChatTemplateError):
    """The caller's template variables (template_kwargs) broke the rendering, e.g. a number where
    the template joins text."""


def chat_template_families() -> list[str]:
    return sorted(path.stem for path in TEMPLATES_DIR.glob("*.jinja"))


@dataclass(frozen=True)
class ChatTemplate:
    family: str
    end_of_turn_token: str
    source: str  # the Jinja text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,  # positional-only, so template variables named "self" or "messages" land in template_kwargs
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (OpenAI-style dicts: role, content, tool_calls, ...).

        template_kwargs reach the template as variables: `enable_thinking` (qwen3),
        `date_string` and `tools_in_user_message` (llama3), `default_system_prompt` (chatml).
        """
        takes_images = self.family in IMAGE_FAMILIES
        variables = {
            # The caller's variables, then the three the template is given by this method.
            **template_kwargs,
            "messages": [_normalize_message(m, i, takes_images) for i, m in enumerate(messages)],
            "tools": list(tools) if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            # One mapping, not keywords: a variable named like render()'s own parameters ("self")
            # is just a variable.
            return _compiled(self.source).render(variables)
        except jinja2.TemplateError as err:
            if isinstance(err, jinja2.TemplateSyntaxError):
                raise  # a bug in our template file, not in the caller's messages
            raise ChatTemplateError(f"{self.family} chat template: {err.message}") from err
        except (TypeError, ValueError) as err:
            if not template_kwargs:
                raise  # our template on our normalized messages: a bug, not the caller's input
            raise ChatTemplateKwargsError(
                f"{self.family} chat template failed with the template variables "
                f"{sorted(template_kwargs)}: {err}"
            ) from err


def chat_template_for(family: str) -> ChatTemplate:
    """The template of a model family: one of chat_template_families()."""
    path = TEMPLATES_DIR / f"{family}.jinja"
    if not path.is_file() or family not in END_OF_TURN_TOKENS:
        raise ValueError(
            f"no chat template for family {family!r}: {TEMPLATES_DIR} holds "
            f"{', '.join(chat_template_families())}; use one of those or add <family>.jinja there"
        )
    return ChatTemplate(family=family, end_of_turn_token=END_OF_TURN_TOKENS[family], source=path.read_text())


def detect_family(tokenizer_config: Mapping[str, Any], model_type: str) -> str:
    """The chat template family of a checkpoint, from its model_type and its own chat template.

    Llama-architecture checkpoints differ: SmolLM2 uses ChatML (<|im_start|>), Llama 3 its
    header tokens. A Llama checkpoint without a template (a base model) gets llama3.
    """
    if model_type in ("gemma3", "gemma3_text"):
        return "gemma3"
    if model_type in ("qwen3", "qwen3_vl"):
        return "qwen3"
    if model_type == "llama":
        shipped = _template_text(tokenizer_config.get("chat_template"))
        if "<|im_start|>" in shipped:
            return "chatml"
        return "llama3"
    raise ValueError(
        f"no chat template family for model_type {model_type!r}; "
        "known: llama (chatml or llama3), qwen3, qwen3_vl, gemma3, gemma3_text"
    )


def read_tokenizer_config(folder: str | PathLike) -> dict[str, Any]:
    """A folder's tokenizer_config.json, with `chat_template` filled from chat_template.jinja
    when the template was saved as its own file (transformers 5's default)."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja_path = folder / "chat_template.jinja"
    if "chat_template" not in config and jinja_path.is_file():
        config["chat_template"] = jinja_path.read_text()
    return config


def _template_text(chat_template: Any) -> str:
    # tokenizer_config may hold one template, or a list of named ones ({"name", "template"}).
    if isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, list):
        return "\n".join(
            str(entry.get("template", "")) for entry in chat_template if isinstance(entry, Mapping)
        )
    return ""


def _normalize_message(message: Mapping[str, Any], index: int, takes_images: bool) -> dict[str, Any]:
    """One shape for the templates: content a string (a user message's with images, when the
    template takes them: its text and image parts), tool-call arguments a dict, reasoning under
    reasoning_content, no empty tool_calls list."""
    if "role" not in message:
        raise ChatTemplateError(f"message {index} has no 'role': {dict(message)!r}")
    normalized = dict(message)
    content = message.get("content")
    if _has_image_part(content):
        if not takes_images or message["role"] != "user":
            raise ChatTemplateError(
                f"message {index} ({message['role']}) has an image part; "
                + ("only user messages hold images" if takes_images else "this chat template takes no images")
            )
        normalized["content"] = [_image_or_text_part(part, index) for part in content]
    else:
        normalized["content"] = _content_text(content, index)
    if not normalized.get("tool_calls"):
        normalized.pop("tool_calls", None)
    else:
        normalized["tool_calls"] = [_normalize_tool_call(call) for call in normalized["tool_calls"]]
    if normalized.get("reasoning_content") is None:
        normalized.pop("reasoning_content", None)
        for alias in _REASONING_ALIASES:
            if isinstance(message.get(alias), str):
                normalized["reasoning_content"] = message[alias]
                break
    return normalized


def _content_text(content: Any, index: int) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"message {index} has a content part of type {kind!r}; only text parts are supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    return content  # a mapping (e.g. a tool result object): the template decides


def _has_image_part(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(part, Mapping) and part.get("type") == "image" for part in content
    )


def _image_or_text_part(part: Any, index: int) -> dict[str, Any]:
    if isinstance(part, Mapping) and part.get("type") == "image":
        return {"type": "image"}
    return {"type": "text", "text": _content_text([part], index)}


def _normalize_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # OpenAI sends arguments as a JSON string; the templates write them with tojson, which
        # would quote the string a second time. Arguments that are not JSON stay as they are:
        # the model produced them so, and sees them back unchanged.
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(arguments)
    if function:
        call["function"] = function
    return call


def _tojson(
    value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; chat templates expect
    # plain json.dumps, as transformers provides it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _compiled(source: str) -> jinja2.Template:
    # The same environment settings as transformers' chat templates, so templates written for
    # it (and ours, compared against them) render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
