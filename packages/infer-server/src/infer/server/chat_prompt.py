"""A chat request's prompt, as the model is fed it: the messages (and tools) rendered by the
model's chat template (ours, never transformers' apply_chat_template), the images decoded and
widened into their placeholder tokens (infer.server.chat_images), the text tokenized once.

/v1/chat/completions runs this prompt and /tokenize counts it, so a chat's token count from
/tokenize is the `usage.prompt_tokens` the chat route reports for the same messages.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from infer.engine.images import PromptImage
from infer.models.chat_template import ChatTemplateError, ChatTemplateKwargsError
from infer.server import chat_images, errors
from infer.server.chat_tools import ToolUse
from infer.server.errors import ApiError
from infer.server.limits import check_prompt_chars
from infer.server.schemas import ChatCompletionRequest, TokenizeRequest
from infer.server.served_models import ServedModel

# Names the template's render() takes itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered template (a forced tool call's opening not included)
    ids: list[int]  # the tokens the model is fed (that opening included)
    images: Sequence[PromptImage]  # the engine's images, over their placeholder runs in `ids`


async def build_chat_prompt(
    model: ServedModel,
    body: ChatCompletionRequest | TokenizeRequest,
    tools: ToolUse | None,
    *,
    call_prefix: str = "",
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> ChatPrompt:
    """The prompt of `body`'s messages. `call_prefix`: text written for the model after the
    template's (a forced tool call's opening); `add_special_tokens`: the tokenizer's own special
    tokens (BOS) on top of what the template writes. ApiError 400 naming the field for messages,
    images or template variables the model cannot take; 413 for a prompt over the server's
    character limit (before it is tokenized)."""
    image_urls = body.image_urls()
    images = []
    if image_urls:  # before rendering, so a model without a vision tower refuses them by name
        images = await run_in_threadpool(
            chat_images.load_images,
            image_urls,
            model.image_processor,
            model.served_model_name,
            model.media_policy,
        )
    text = await run_in_threadpool(_render, model, body, tools, add_generation_prompt)
    check_prompt_chars(len(text), model.max_prompt_chars, "messages")
    ids, engine_images = await run_in_threadpool(
        chat_images.encode_with_images,
        text + call_prefix,
        images,
        model.image_processor,
        body,
        model.engine.tokenizer,
        add_special_tokens=add_special_tokens,
    )
    return ChatPrompt(text, ids, engine_images)


def _render(
    model: ServedModel,
    body: ChatCompletionRequest | TokenizeRequest,
    tools: ToolUse | None,
    add_generation_prompt: bool,
) -> str:
    reserved = [name for name in _RESERVED_TEMPLATE_KWARGS if name in body.chat_template_kwargs]
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs may not set {reserved}: the server passes them; remove them",
            errors.INVALID_REQUEST,
            "chat_template_kwargs",
            "invalid_value",
        )
    template = model.engine.model_info.chat_template
    try:
        return template.render(
            body.template_messages(),
            add_generation_prompt=add_generation_prompt,
            tools=tools.template_tools if tools is not None else None,
            **body.template_kwargs(),
        )
    except ChatTemplateKwargsError as error:  # e.g. {"default_system_prompt": 5}
        raise ApiError(
            400, str(error), errors.INVALID_REQUEST, "chat_template_kwargs", "invalid_value"
        ) from None
    except ChatTemplateError as error:  # the template refused these messages (e.g. a role order)
        raise ApiError(400, str(error), errors.INVALID_REQUEST, "messages", "invalid_value") from None
