"""POST /tokenize and POST /detokenize, vLLM's tokenizer endpoints (vllm/entrypoints/serve/tokenize:
protocol.py for the bodies, serving.py for what they mean).

/tokenize takes text (`prompt`; the tokenizer's special tokens added unless `add_special_tokens`
is false) or a chat (`messages`, `tools`, `chat_template_kwargs`, `add_generation_prompt`), which
becomes the very prompt /v1/chat/completions runs (infer.server.chat_prompt). It answers
`{"count", "max_model_len", "tokens", "token_strs"}`: `token_strs` (each id's vocabulary entry)
with `return_token_strs`, else null. The count is not held to the context, since telling whether
a text fits `max_model_len` is what clients ask for; the size limits of the generation routes
(--max-request-bytes, --max-prompt-chars) apply.

/detokenize takes `tokens` and answers `{"prompt": text}`, special tokens written out as vLLM
decodes them; an id outside the vocabulary is a 400 naming it.

`model` may be left out (or null): the default model (the first served); a model named must be
served here (404 otherwise), and is loaded if it is not.
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infer.server import chat_tools, errors
from infer.server.chat_prompt import build_chat_prompt
from infer.server.errors import ApiError, parse_request
from infer.server.limits import check_prompt_chars, read_body
from infer.server.schemas import TOKENIZE_CHAT_FIELDS, DetokenizeRequest, TokenizeRequest
from infer.server.served_models import ServedModel
from infer.server.server_state import ServerState

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    model, body = await _read(request, TokenizeRequest)
    _check_one_input(body)
    tokenizer = model.engine.tokenizer
    if body.messages is not None:
        # tool_choice is not part of vLLM's body: the tools are shown as with "auto".
        tools = chat_tools.tool_use(body.tools, None)
        chat_prompt = await build_chat_prompt(
            model,
            body,
            tools,
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=body.adds_special_tokens,
        )
        ids = chat_prompt.ids
    else:
        check_prompt_chars(len(body.prompt), model.max_prompt_chars, "prompt")
        ids = await run_in_threadpool(
            tokenizer.encode, body.prompt, add_special_tokens=body.adds_special_tokens
        )
    token_strs = None
    if body.return_token_strs:
        token_strs = await run_in_threadpool(tokenizer.hf_tokenizer.convert_ids_to_tokens, ids)
    return JSONResponse(
        {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": token_strs}
    )


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    model, body = await _read(request, DetokenizeRequest)
    tokenizer = model.engine.tokenizer
    vocab_size = tokenizer.vocab_size
    # The tokenizer would drop an id outside the vocabulary without a word (or overflow on a huge one).
    index = next((index for index, token_id in enumerate(body.tokens) if token_id >= vocab_size), None)
    if index is not None:
        raise ApiError(
            400,
            f"tokens.{index}: {body.tokens[index]} is not a token id of this model's vocabulary "
            f"(0 to {vocab_size - 1})",
            errors.INVALID_REQUEST,
            f"tokens.{index}",
            "invalid_value",
        )
    text = await run_in_threadpool(tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


async def _read(
    request: Request, body_model: type[TokenizeRequest | DetokenizeRequest]
) -> tuple[ServedModel, TokenizeRequest | DetokenizeRequest]:
    """The model the request names (the default one if none) and its body as `body_model`."""
    server: ServerState = request.app.state.server
    body = parse_request(body_model, await read_body(request, server.limits.max_request_bytes))
    return await server.model_for(request, body.model), body


def _check_one_input(body: TokenizeRequest) -> None:
    """ApiError 400 unless the body holds exactly one of `prompt` and `messages`, and no chat
    field beside a prompt (it would be ignored: the text is tokenized as it is)."""
    if body.prompt is None and body.messages is None:
        raise ApiError(
            400,
            "missing required field 'prompt': send prompt (text to tokenize) or messages (a chat)",
            errors.INVALID_REQUEST,
            "prompt",
            "missing_required_parameter",
        )
    if body.prompt is not None and body.messages is not None:
        raise ApiError(
            400,
            "messages: send prompt (text) or messages (a chat), not both",
            errors.INVALID_REQUEST,
            "messages",
            "invalid_value",
        )
    if body.prompt is not None:
        for name in TOKENIZE_CHAT_FIELDS:
            if name in body.model_fields_set:
                raise ApiError(
                    400,
                    f"{name} applies to a chat (messages); this request tokenizes a prompt, so leave "
                    f"{name} out",
                    errors.INVALID_REQUEST,
                    name,
                    "invalid_value",
                )
