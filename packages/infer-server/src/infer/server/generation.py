"""The part of a generation request that /v1/completions and /v1/chat/completions share.

prompt ids -> `sampling_params` (the token limit checked against the context) -> `submit` (engine
errors become API errors) -> either `collect` (one body; the request is aborted if the client
hangs up while it waits) or `EventStreamResponse` over `stream_events` (SSE; aborted when the
client goes away). A chat answer that is parsed (tools, thinking) streams through
`parsed_chat_events` instead, which feeds its text to an `infer.server.chat_output` parser.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from infer.engine.request import (
    FINISH_ABORT,
    InvalidParamError,
    QueueFullError,
    RequestTooLongError,
    StepOutput,
)
from infer.engine.sampling_params import SamplingParams
from infer.server import errors, responses
from infer.server.chat_output import ChatOutputParser, ChatPiece, ContentPiece, ReasoningPiece, finish_reason
from infer.server.engine_loop import EngineLoop, RequestHandle
from infer.server.errors import ApiError
from infer.server.schemas import ChatCompletionRequest, CompletionRequest
from infer.server.sse import DONE, ChatStream, CompletionStream, error_event


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    prompt_field: str,
    extra_stop: Sequence[str] = (),
) -> SamplingParams:
    """The request's SamplingParams; no token limit means "as many as the context leaves".
    `extra_stop`: the server's own stop strings besides the client's (e.g. a forced tool call's
    closing marker). ApiError 400 context_length_exceeded when prompt + limit do not fit."""
    room = max_model_len - num_prompt_tokens
    kwargs = body.to_sampling_kwargs(max_new_tokens_default=max(room, 1))
    kwargs["stop"] += [text for text in extra_stop if text not in kwargs["stop"]]
    max_new_tokens = kwargs["max_new_tokens"]
    if num_prompt_tokens + max_new_tokens > max_model_len:
        raise errors.context_length_exceeded(num_prompt_tokens, max_new_tokens, max_model_len, prompt_field)
    if kwargs["min_tokens"] > max_new_tokens:
        message = f"min_tokens ({kwargs['min_tokens']}) must not exceed the token limit ({max_new_tokens})"
        raise ApiError(400, message, errors.INVALID_REQUEST, "min_tokens", "invalid_value")
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:  # the schema should have caught it; name it rather than a 500
        raise ApiError(400, str(error), errors.INVALID_REQUEST, None, "invalid_value") from None


def submit(
    engine_loop: EngineLoop, prompt_ids: list[int], params: SamplingParams, request_id: str, prompt_field: str
) -> RequestHandle:
    try:
        return engine_loop.submit(prompt_ids, params, request_id)
    except QueueFullError:
        raise errors.queue_full(engine_loop.engine.config.max_queue_len) from None
    except RequestTooLongError as error:
        raise ApiError(
            400, str(error), errors.INVALID_REQUEST, prompt_field, "context_length_exceeded"
        ) from None
    except InvalidParamError as error:  # e.g. a logit_bias id outside the vocabulary
        raise ApiError(400, str(error), errors.INVALID_REQUEST, error.param, "invalid_value") from None
    except ValueError as error:  # e.g. a token id outside the vocabulary
        raise ApiError(400, str(error), errors.INVALID_REQUEST, prompt_field, "invalid_value") from None


# -- one body -----------------------------------------------------------------------------------


@dataclass
class Collected:
    text: str
    token_ids: list[int] = field(default_factory=list)
    final: StepOutput | None = None


async def collect(request: Request, engine_loop: EngineLoop, handle: RequestHandle) -> Collected | None:
    """Waits for the whole answer. None when the client hung up first: the request is aborted
    then, so a client that gives up does not keep a slot busy."""
    gone = asyncio.ensure_future(_client_disconnect(request.receive))
    try:
        await asyncio.wait({handle.done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not handle.finished:  # the client went away, or this handler was cancelled
            engine_loop.abort(handle, client_gone=True)
    if not handle.finished:
        return None
    outputs = [handle.outputs.get_nowait() for _ in range(handle.outputs.qsize())]
    final = outputs[-1]
    if final.error is not None:
        raise errors.internal_error(final.error)
    if final.finish_reason == FINISH_ABORT:  # the client is still here: the server cancelled it
        raise errors.cancelled_by_server()
    return Collected(
        text="".join(output.text_delta for output in outputs),
        token_ids=[output.token_id for output in outputs if output.token_id is not None],
        final=final,
    )


async def _client_disconnect(receive: Receive) -> None:
    # The body is read: the next message is http.disconnect, whenever the client hangs up.
    while (await receive())["type"] != "http.disconnect":
        pass


# -- a stream -------------------------------------------------------------------------------------


async def stream_events(
    handle: RequestHandle, stream: CompletionStream | ChatStream, *, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE events of one answer: (chat: the role chunk), a chunk per piece of text with the
    token ids since the last piece, one terminal chunk with finish_reason (then the usage chunk
    if asked for), and [DONE]. An engine failure ends it with one error event, then [DONE]."""
    is_chat = isinstance(stream, ChatStream)
    piece_event = stream.content if is_chat else stream.text
    if is_chat:
        yield stream.role()
    # Token ids whose text is still held back (a partial character or a possible stop string).
    pending_ids: list[int] = []
    while True:
        output = await handle.outputs.get()
        if output.token_id is not None:
            pending_ids.append(output.token_id)
        if output.finished:
            break
        if output.text_delta:
            yield piece_event(output.text_delta, pending_ids)
            pending_ids = []
    if output.error is not None or output.finish_reason == FINISH_ABORT:
        yield error_event(_unfinished(output))
    else:
        yield stream.finish(output.finish_reason, output.text_delta, pending_ids)
        if include_usage:
            yield stream.usage(responses.usage(output.prompt_tokens, output.completion_tokens))
    yield DONE


async def parsed_chat_events(
    handle: RequestHandle, stream: ChatStream, chat_output: ChatOutputParser, *, include_usage: bool
) -> AsyncIterator[bytes]:
    """`stream_events` for a chat answer whose text goes through `chat_output`: content,
    reasoning and whole tool calls each in their own chunks, text that may open a tool call held
    back until it is decided, finish_reason "tool_calls" when a call was made."""
    yield stream.role()
    pending_ids: list[int] = []  # token ids not yet sent with a chunk
    num_calls_sent = 0
    while True:
        output = await handle.outputs.get()
        if output.token_id is not None:
            pending_ids.append(output.token_id)
        if output.finished:
            break
        for piece in chat_output.feed(output.text_delta):
            yield _piece_event(stream, piece, num_calls_sent, pending_ids)
            num_calls_sent += not isinstance(piece, ContentPiece | ReasoningPiece)
            pending_ids = []
    if output.error is not None or output.finish_reason == FINISH_ABORT:
        yield error_event(_unfinished(output))
    else:
        for piece in chat_output.feed(output.text_delta) + chat_output.finish():
            yield _piece_event(stream, piece, num_calls_sent, pending_ids)
            num_calls_sent += not isinstance(piece, ContentPiece | ReasoningPiece)
            pending_ids = []
        yield stream.finish(finish_reason(output.finish_reason, chat_output.num_tool_calls), "", pending_ids)
        if include_usage:
            yield stream.usage(responses.usage(output.prompt_tokens, output.completion_tokens))
    yield DONE


def _unfinished(output: StepOutput) -> ApiError:
    """Why a stream ends without an answer: the engine failed, or the server cancelled it (a
    client that went away reads no more events)."""
    return errors.internal_error(output.error) if output.error is not None else errors.cancelled_by_server()


def _piece_event(stream: ChatStream, piece: ChatPiece, call_index: int, token_ids: list[int]) -> bytes:
    if isinstance(piece, ContentPiece):
        return stream.content(piece.text, token_ids)
    if isinstance(piece, ReasoningPiece):
        return stream.reasoning(piece.text, token_ids)
    return stream.tool_call(call_index, responses.new_tool_call_id(), piece.name, piece.arguments, token_ids)


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that aborts its request when it ends before the request
    did: the client hung up (Starlette stops the stream on http.disconnect) or the send failed."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], engine_loop: EngineLoop, handle: RequestHandle):
        # no-cache and X-Accel-Buffering: proxies must pass each event on as it comes.
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine_loop, self._handle = engine_loop, handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_loop.abort(self._handle, client_gone=True)  # a no-op once it finished
