"""A chat request on its way into the engine, as /v1/chat/completions and /v1/messages both run
it: the tools checked (infer.server.chat_tools), the prompt built (infer.server.chat_prompt, a
forced call's opening included), the sampling settings (a forced call's grammar included), one
output parser per choice (tools, thinking), and the engine requests submitted.

The routes differ only in how they read the request and how they write the answer: Anthropic's
Messages API is translated into a ChatCompletionRequest first (infer.server.messages_request),
so the same conversation is the same prompt, the same tokens and the same greedy answer on both.
"""

from dataclasses import dataclass

from infer.engine.sampling_params import SamplingParams
from infer.server import chat_tools, errors
from infer.server.chat_output import ChatAnswer, ChatOutputParser
from infer.server.chat_prompt import ChatPrompt, build_chat_prompt
from infer.server.engine_loop import EngineLoop, RequestHandle
from infer.server.errors import ApiError
from infer.server.generation import sampling_params, submit
from infer.server.reasoning import prompt_opens_reasoning
from infer.server.schemas import ChatCompletionRequest
from infer.server.served_models import ServedModel
from infer.server.server_state import ServerState
from infer.server.tool_parsers import ToolCallFormat, tool_call_format

# Families whose chat template has a thinking switch (`enable_thinking`) and whose answers open
# with a think block when it is on (infer.server.reasoning).
THINKING_FAMILIES = frozenset({"qwen3"})


@dataclass
class ChatRun:
    """A submitted chat request: its prompt, one engine request per choice and the parser that
    reads each choice's text (None: the text is all content, untouched)."""

    engine_loop: EngineLoop
    prompt: ChatPrompt
    handles: list[RequestHandle]
    output_parsers: list[ChatOutputParser | None]

    def answer(self, index: int, text: str) -> ChatAnswer:
        """Choice `index`'s whole text as content, reasoning and tool calls."""
        parser = self.output_parsers[index]
        return parser.parse(text) if parser is not None else ChatAnswer(text, None)


def thinks(family: str, body: ChatCompletionRequest) -> bool:
    """Whether the answer opens with the model's thinking. Qwen 3 thinks unless told not to, as
    its template and model card have it."""
    return family in THINKING_FAMILIES and body.template_kwargs().get("enable_thinking", True) is not False


@dataclass
class PreparedChat:
    """A chat request checked and its prompt built, not yet submitted."""

    prompt: ChatPrompt
    params: SamplingParams
    output_parsers: list[ChatOutputParser | None]


async def prepare_chat(model: ServedModel, body: ChatCompletionRequest) -> PreparedChat:
    """Checks `body` against `model` (the one it names, from ServerState.model_for) and builds
    its prompt and settings. ApiError (400 naming the field, 413) for a request that cannot run."""
    tools = chat_tools.tool_use(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools is not None and tools.forced and body.grammar_field is not None:
        raise ApiError(
            400,
            f"{body.grammar_field}: a forced tool call (tool_choice required or named) is held to "
            "its tools' grammar; send either that tool_choice or the output constraint",
            errors.INVALID_REQUEST,
            body.grammar_field,
            "invalid_value",
        )
    family = model.engine.model_info.chat_template.family
    tool_format = tool_call_format(family) if tools is not None else None
    call_prefix = tools.call_prefix(tool_format) if tools is not None else ""
    chat_prompt = await build_chat_prompt(model, body, tools, call_prefix=call_prefix)
    params = sampling_params(
        body,
        len(chat_prompt.ids),
        model.max_model_len,
        prompt_field="messages",
        grammar=tools.grammar(tool_format) if tools is not None else None,
    )
    # One parser per choice: each reads its own text.
    parsers = [
        _output_parser(family, body, chat_prompt.text, tools, tool_format, call_prefix) for _ in range(body.n)
    ]
    return PreparedChat(chat_prompt, params, parsers)


async def start_chat(
    server: ServerState, model: ServedModel, body: ChatCompletionRequest, request_id: str
) -> ChatRun:
    """`prepare_chat`, then its `n` choices submitted (ApiError 503 when the queue is full or the
    server began draining meanwhile)."""
    prepared = await prepare_chat(model, body)
    server.require_ready()
    engine_loop = model.engine_loop
    handles = submit(
        engine_loop,
        [(prepared.prompt.ids, prepared.params)],
        request_id,
        prompt_field="messages",
        n=body.n,
        cache_salt=body.cache_salt,
        images=prepared.prompt.images,
    )
    return ChatRun(engine_loop, prepared.prompt, handles, prepared.output_parsers)


def _output_parser(
    family: str,
    body: ChatCompletionRequest,
    prompt: str,
    tools: chat_tools.ToolUse | None,
    tool_format: ToolCallFormat | None,
    call_prefix: str,
) -> ChatOutputParser | None:
    """How to read this answer; None when its text is all content (no tools, no thinking split)."""
    thinking = thinks(family, body)
    if tools is None and not thinking:
        return None
    return ChatOutputParser(
        thinking=thinking,
        starts_in_reasoning=thinking and prompt_opens_reasoning(prompt),
        tool_format=tool_format,
        tool_names=tools.tool_names if tools is not None else (),
        call_prefix=call_prefix,
        max_tool_calls=1 if tools is not None and not tools.parallel_calls else None,
    )
