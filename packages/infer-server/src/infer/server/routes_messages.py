"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, as vLLM
(vllm/entrypoints/anthropic) and llama.cpp's server serve it to clients built on the Anthropic
SDK.

The request is translated into a chat request (infer.server.messages_request) and runs as the
chat route runs it (infer.server.chat_run): the same prompt, tools, grammar and parsers, so a
conversation's greedy answer is the chat route's. The answer is written in Anthropic's shape
(infer.server.messages_response): one body, or SSE events (`message_start`, a
`content_block_start` / `content_block_delta`... / `content_block_stop` per block,
`message_delta` with the stop reason and usage, `message_stop`). A client that hangs up stops
its request, streamed or not, as on the other routes.

Every error on these routes is Anthropic's error object, a stream's as an `error` event.
count_tokens answers `{"input_tokens": N}`, the `usage.input_tokens` of the same request.
"""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from infer.server import messages_response
from infer.server.chat_output import ChatOutputParser, ContentPiece, ReasoningPiece, finish_reason
from infer.server.chat_run import THINKING_FAMILIES, ChatRun, prepare_chat, start_chat
from infer.server.engine_loop import RequestHandle
from infer.server.errors import CLIENT_CLOSED_REQUEST, ApiError, parse_request
from infer.server.generation import EventStreamResponse, collect, unfinished_error
from infer.server.limits import read_body
from infer.server.messages_request import CountTokensRequest, MessagesRequest
from infer.server.messages_response import MessageEvents
from infer.server.served_models import ServedModel
from infer.server.server_state import RETRY_AFTER_S, ServerState

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    try:
        return await _create_message(request)
    except ApiError as error:
        return error_response(error)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    try:
        _, model, body = await _read(request, CountTokensRequest)
        prepared = await prepare_chat(model, body.to_chat_request(_has_thinking_switch(model)))
        return JSONResponse({"input_tokens": len(prepared.prompt.ids)})
    except ApiError as error:
        return error_response(error)


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    body = messages_response.error_body(error.status, _anthropic_names(error.message))
    return JSONResponse(body, status_code=error.status, headers=headers)


def _anthropic_names(message: str) -> str:
    """An error of the chat pipeline names a tool's fields as the chat request has them; here
    they are named as the Messages request has them (`tools.0.input_schema.properties.city`)."""
    for chat_name, messages_name in _CHAT_TOOL_FIELDS:
        message = message.replace(chat_name, messages_name)
    return message


_CHAT_TOOL_FIELDS = (
    (".function.parameters", ".input_schema"),
    ("tool_choice.function.name", "tool_choice.name"),
    (".function.name", ".name"),
)


async def _create_message(request: Request) -> Response:
    server, model, body = await _read(request, MessagesRequest)
    message_id = messages_response.new_message_id()
    run = await start_chat(server, model, body.to_chat_request(_has_thinking_switch(model)), message_id)
    (handle,) = run.handles
    if body.stream:
        events = _message_events(run, handle, message_id, body.model)
        return EventStreamResponse(events, run.engine_loop, run.handles)
    collected = await collect(request, run.engine_loop, run.handles)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    (choice,) = collected
    parser = run.output_parsers[0]
    pieces = parser.feed(choice.text) + parser.finish() if parser is not None else [ContentPiece(choice.text)]
    num_calls = sum(not isinstance(piece, ContentPiece | ReasoningPiece) for piece in pieces)
    final = choice.final
    handle.answered(finish_reason(final.finish_reason, num_calls))
    reason, stop_sequence = messages_response.stop_reason(final, num_calls)
    return JSONResponse(
        messages_response.message(
            message_id,
            body.model,
            messages_response.content_blocks(pieces),
            reason,
            stop_sequence,
            messages_response.usage(final.prompt_tokens, final.completion_tokens),
        )
    )


async def _read(request: Request, body_model: type[MessagesRequest | CountTokensRequest]):
    """The server, the model the request names (its template decides what `thinking` means)
    and the body."""
    server: ServerState = request.app.state.server
    body = parse_request(body_model, await read_body(request, server.limits.max_request_bytes))
    return server, await server.model_for(request, body.model), body


def _has_thinking_switch(model: ServedModel) -> bool:
    return model.engine.model_info.chat_template.family in THINKING_FAMILIES


async def _message_events(
    run: ChatRun, handle: RequestHandle, message_id: str, model: str
) -> AsyncIterator[bytes]:
    """The SSE events of one streamed message; an answer the engine could not finish ends with
    an `error` event instead of `message_delta` and `message_stop`."""
    parser: ChatOutputParser | None = run.output_parsers[0]
    events = MessageEvents(message_id, model, len(run.prompt.ids))
    yield events.start()
    while True:
        output = await handle.outputs.get()
        if output.finished:
            break
        for event in _piece_events(events, parser, output.text_delta):
            yield event
    error = unfinished_error(handle, output)
    if error is not None:
        yield messages_response.error_event(error)
        return
    for event in _piece_events(events, parser, output.text_delta, finished=True):
        yield event
    num_calls = parser.num_tool_calls if parser is not None else 0
    handle.answered(finish_reason(output.finish_reason, num_calls))
    reason, stop_sequence = messages_response.stop_reason(output, num_calls)
    for event in events.finish(reason, stop_sequence, output.completion_tokens):
        yield event


def _piece_events(
    events: MessageEvents, parser: ChatOutputParser | None, text: str, finished: bool = False
) -> list[bytes]:
    if parser is None:  # all of the text is content, untouched (as the chat route sends it)
        return events.text(text) if text else []
    pieces = parser.feed(text) + (parser.finish() if finished else [])
    return events.pieces(pieces)
