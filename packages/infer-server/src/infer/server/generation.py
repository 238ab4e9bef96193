"""The part of a generation request that /v1/completions and /v1/chat/completions share.

prompt ids -> `sampling_params` (the token limit checked against the context) -> `submit` (one
engine request per choice, `n` of them; engine errors become API errors) -> either `collect` (one
body; the requests are aborted if the client hangs up while it waits) or `EventStreamResponse`
over `answer_events` (SSE; aborted when the client goes away), which interleaves each choice's
`choice_events` as they come. A chat answer that is parsed (tools, thinking) streams each choice
through `parsed_choice_events` instead, which feeds its text to an `infer.server.chat_output`
parser.

`n > 1` is n independent requests for the same prompt, as vLLM runs it: with a `seed`, choice i
draws from seed + i, so the choices differ and the answer is reproducible.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from infer.engine.client import EngineDeadError
from infer.engine.grammar_spec import GrammarSpec
from infer.engine.images import PromptImage
from infer.engine.output_processor import StepOutput
from infer.engine.protocol import FINISH_ABORT, PromptLogprobs, TokenLogprobs
from infer.engine.request import InvalidParamError, QueueFullError, RequestTooLongError
from infer.engine.sampling_params import SamplingParams
from infer.server import errors, responses
from infer.server.chat_output import ChatOutputParser, ChatPiece, ContentPiece, ReasoningPiece, finish_reason
from infer.server.engine_loop import EngineLoop, RequestHandle
from infer.server.errors import ApiError
from infer.server.logprobs import ChoiceLogprobs
from infer.server.schemas import ChatCompletionRequest, CompletionRequest
from infer.server.sse import DONE, ChatStream, CompletionStream, error_event


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    prompt_field: str,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """The request's SamplingParams; no token limit means "as many as the context leaves".
    `grammar`: the server's own constraint (a forced tool call's), which takes the place of
    `response_format`'s, since the answer is then a call and has no content.
    ApiError 400 context_length_exceeded when prompt + limit do not fit."""
    room = max_model_len - num_prompt_tokens
    kwargs = body.to_sampling_kwargs(max_new_tokens_default=max(room, 1))
    if grammar is not None:
        kwargs["grammar"] = grammar
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
    engine_loop: EngineLoop,
    prompts: Sequence[tuple[list[int], SamplingParams]],
    request_id: str,
    prompt_field: str,
    n: int = 1,
    cache_salt: str | None = None,
    images: Sequence[PromptImage] = (),
) -> list[RequestHandle]:
    """One engine request per choice: `n` per (prompt ids, params), in the answer's order
    (prompt by prompt, n each); `images` (chat, one prompt) go with each choice. All or none:
    when one cannot be queued, those queued before it are aborted and the error is raised."""
    many = len(prompts) * n > 1
    handles: list[RequestHandle] = []
    try:
        for prompt_ids, params in prompts:
            for index in range(n):
                choice_id = f"{request_id}-{len(handles)}" if many else request_id
                choice_params = _choice_params(params, index)
                handles.append(
                    _submit_one(
                        engine_loop, prompt_ids, choice_params, choice_id, prompt_field, cache_salt, images
                    )
                )
    except ApiError:
        for handle in handles:
            engine_loop.abort(handle, client_gone=False)
        raise
    return handles


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s settings: seed + index when seeded (wrapped into int64)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)


def _submit_one(
    engine_loop: EngineLoop,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    prompt_field: str,
    cache_salt: str | None,
    images: Sequence[PromptImage],
) -> RequestHandle:
    try:
        return engine_loop.submit(prompt_ids, params, request_id, cache_salt, images)
    except QueueFullError:
        raise errors.queue_full(engine_loop.engine.config.max_queue_len) from None
    except EngineDeadError as error:  # it died since the route checked /health's state
        raise errors.engine_unavailable(str(error)) from None
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
    # One per token: its TokenLogprobs when the request asked for them, else None.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Every output as it came (their text deltas join to `text`), for a reader that needs to
    # know which tokens wrote which text.
    outputs: list[StepOutput] = field(default_factory=list)

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's logprobs, when the request asked for them (they come with its first token)."""
        return next(
            (output.prompt_logprobs for output in self.outputs if output.prompt_logprobs is not None), None
        )


async def collect(
    request: Request, engine_loop: EngineLoop, handles: Sequence[RequestHandle]
) -> list[Collected] | None:
    """Waits for every choice's whole answer. None when the client hung up first: the requests
    are aborted then, so a client that gives up does not keep slots busy."""
    gone = asyncio.ensure_future(_client_disconnect(request.receive))
    # asyncio.wait, not gather: the handles' futures belong to the engine loop, which resolves
    # them later; nothing here may cancel them.
    pending = {handle.done for handle in handles}
    try:
        while pending and not gone.done():
            finished, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            pending -= finished
    finally:
        gone.cancel()
        for handle in handles:
            if not handle.finished:  # the client went away, or this handler was cancelled
                engine_loop.abort(handle, client_gone=True)
    if not all(handle.finished for handle in handles):
        return None
    collected = []
    for handle in handles:
        outputs = [handle.outputs.get_nowait() for _ in range(handle.outputs.qsize())]
        final = outputs[-1]
        if final.error is not None or final.finish_reason == FINISH_ABORT:
            raise _unfinished(handle, final)
        tokens = [output for output in outputs if output.token_id is not None]
        collected.append(
            Collected(
                text="".join(output.text_delta for output in outputs),
                token_ids=[output.token_id for output in tokens],
                final=final,
                logprobs=[output.logprobs for output in tokens],
                outputs=outputs,
            )
        )
    return collected


def total_usage(
    finals: Sequence[StepOutput], choices_per_prompt: int = 1, report_cached: bool = False
) -> dict:
    """The usage of one answer: each prompt once (its n choices share it), the tokens of every
    choice. `finals` are in answer order: prompt by prompt, `choices_per_prompt` each.
    `report_cached` (the engine caches prefixes): with prompt_tokens_details.cached_tokens, the
    prompt tokens the prefix cache served (each prompt's first choice's)."""
    prompt_tokens = sum(final.prompt_tokens for final in finals[::choices_per_prompt])
    cached = sum(final.cached_tokens for final in finals[::choices_per_prompt]) if report_cached else None
    return responses.usage(prompt_tokens, sum(final.completion_tokens for final in finals), cached)


async def _client_disconnect(receive: Receive) -> None:
    # The body is read: the next message is http.disconnect, whenever the client hangs up.
    while (await receive())["type"] != "http.disconnect":
        pass


# -- a stream -------------------------------------------------------------------------------------


class _Unfinished(Exception):
    """A choice ended without an answer: the engine failed, or the server cancelled it."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


async def answer_events(
    choices: Sequence[AsyncIterator[bytes]],
    handles: Sequence[RequestHandle],
    usage_stream: CompletionStream | ChatStream | None,
    choices_per_prompt: int = 1,
    report_cached: bool = False,
) -> AsyncIterator[bytes]:
    """The SSE events of one answer: every choice's chunks as they come, then the usage chunk
    (when `usage_stream` is given: the client asked for it) and [DONE]. A choice that ends
    without an answer ends the whole answer with one error event, then [DONE]."""
    try:
        async for event_bytes in _interleaved(choices):
            yield event_bytes
    except _Unfinished as unfinished:
        yield error_event(unfinished.error)
    else:
        if usage_stream is not None:
            finals = [handle.done.result() for handle in handles]
            yield usage_stream.usage(total_usage(finals, choices_per_prompt, report_cached))
    yield DONE


async def _interleaved(sources: Sequence[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of every source in the order they come; the first _Unfinished ends it."""
    if len(sources) == 1:  # n = 1, the common case: no tasks
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    source_done = object()

    async def pump(source: AsyncIterator[bytes]) -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
        except _Unfinished as unfinished:
            queue.put_nowait(unfinished)
        finally:
            queue.put_nowait(source_done)

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is source_done:
                remaining -= 1
            elif isinstance(item, _Unfinished):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class _PendingTokens:
    """A streamed choice's tokens not yet sent with a chunk (their text is held back, or is the
    next chunk's), and their logprobs when the client asked for them."""

    def __init__(self, logprobs: ChoiceLogprobs | None):
        self.token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._renderer = logprobs

    def add(self, output: StepOutput) -> None:
        if output.token_id is not None:
            self.token_ids.append(output.token_id)
            if self._renderer is not None:
                self._logprobs.append(output.logprobs)

    def take(self) -> tuple[list[int], dict | None]:
        """(the token ids, their rendered logprobs or None) for the next chunk; empties."""
        token_ids, self.token_ids = self.token_ids, []
        logprobs, self._logprobs = self._logprobs, []
        rendered = self._renderer.render(token_ids, logprobs) if self._renderer is not None else None
        return token_ids, rendered


async def _next_outputs(handle: RequestHandle, pending: _PendingTokens) -> tuple[str, StepOutput]:
    """Waits for the choice's next output, then takes every output already queued behind it (up
    to the final one): (their text, the last of them); their tokens go to `pending`. A stream
    that keeps up sends a chunk per token; one that fell behind (the server busy with many
    streams) catches up in one chunk instead of a chunk per token, as vLLM's streams do."""
    output = await handle.outputs.get()
    pending.add(output)
    if output.finished or handle.outputs.empty():
        return output.text_delta, output
    pieces = [output.text_delta]
    while not output.finished and not handle.outputs.empty():
        output = handle.outputs.get_nowait()
        pending.add(output)
        pieces.append(output.text_delta)
    return "".join(pieces), output


async def choice_events(
    handle: RequestHandle,
    stream: CompletionStream | ChatStream,
    prefix: str = "",
    logprobs: ChoiceLogprobs | None = None,
) -> AsyncIterator[bytes]:
    """The chunks of one choice: (chat: the role chunk), `prefix` if any (echo's prompt text, in
    a chunk of its own), a chunk per piece of text with the token ids since the last piece (and
    their logprobs, rendered by `logprobs` when given), and one terminal chunk with
    finish_reason. Raises _Unfinished when the choice ends without an answer."""
    is_chat = isinstance(stream, ChatStream)
    piece_event = stream.content if is_chat else stream.text
    if is_chat:
        yield stream.role()
    if prefix:
        yield piece_event(prefix)
    # Tokens whose text is still held back (a partial character or a possible stop string).
    pending = _PendingTokens(logprobs)
    while True:
        text, output = await _next_outputs(handle, pending)
        if output.finished:
            break
        if text:
            yield piece_event(text, *pending.take())
    if output.error is not None or output.finish_reason == FINISH_ABORT:
        raise _Unfinished(_unfinished(handle, output))
    yield stream.finish(output.finish_reason, text, *pending.take())


async def parsed_choice_events(
    handle: RequestHandle,
    stream: ChatStream,
    chat_output: ChatOutputParser,
    logprobs: ChoiceLogprobs | None = None,
) -> AsyncIterator[bytes]:
    """`choice_events` for a chat choice whose text goes through `chat_output`: content,
    reasoning and whole tool calls each in their own chunks, text that may open a tool call held
    back until it is decided, finish_reason "tool_calls" when a call was made. A chunk carries
    the tokens (and logprobs) that came since the previous chunk."""
    yield stream.role()
    pending = _PendingTokens(logprobs)
    num_calls_sent = 0
    while True:
        text, output = await _next_outputs(handle, pending)
        if output.finished:
            break
        for piece in chat_output.feed(text):
            yield _piece_event(stream, piece, num_calls_sent, *pending.take())
            num_calls_sent += not isinstance(piece, ContentPiece | ReasoningPiece)
    if output.error is not None or output.finish_reason == FINISH_ABORT:
        raise _Unfinished(_unfinished(handle, output))
    for piece in chat_output.feed(text) + chat_output.finish():
        yield _piece_event(stream, piece, num_calls_sent, *pending.take())
        num_calls_sent += not isinstance(piece, ContentPiece | ReasoningPiece)
    reason = finish_reason(output.finish_reason, chat_output.num_tool_calls)
    handle.answered(reason)
    yield stream.finish(reason, "", *pending.take())


def unfinished_error(handle: RequestHandle, final: StepOutput) -> ApiError | None:
    """Why a choice whose last output is `final` ended without an answer; None when it has one."""
    if final.error is None and final.finish_reason != FINISH_ABORT:
        return None
    return _unfinished(handle, final)


def _unfinished(handle: RequestHandle, final: StepOutput) -> ApiError:
    """Why a choice ends without an answer: the engine died (503: retry once it is back), its
    batch's forward failed (500), or the server cancelled it (503; a client that went away reads
    no more events)."""
    if handle.engine_failed:
        return errors.engine_unavailable(final.error or "")
    if final.error is not None:
        return errors.internal_error(final.error)
    return errors.cancelled_by_server()


def _piece_event(
    stream: ChatStream, piece: ChatPiece, call_index: int, token_ids: list[int], logprobs: dict | None
) -> bytes:
    if isinstance(piece, ContentPiece):
        return stream.content(piece.text, token_ids, logprobs)
    if isinstance(piece, ReasoningPiece):
        return stream.reasoning(piece.text, token_ids, logprobs)
    call_id = responses.new_tool_call_id()
    return stream.tool_call(call_index, call_id, piece.name, piece.arguments, token_ids, logprobs)


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that aborts its requests when it ends before they did: the
    client hung up (Starlette stops the stream on http.disconnect), the send failed, or one
    choice failed and ended the answer."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], engine_loop: EngineLoop, handles: Sequence[RequestHandle]
    ):
        # no-cache and X-Accel-Buffering: proxies must pass each event on as it comes.
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine_loop, self._handles = engine_loop, handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self._handles:
                self._engine_loop.abort(handle, client_gone=True)  # a no-op once it finished
