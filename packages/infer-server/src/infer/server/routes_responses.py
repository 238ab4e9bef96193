"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A body (infer.server.responses_request) is read as a chat request (infer.server.responses_chat),
prepared and run as the chat route runs it (infer.server.chat_run: the same prompt tokens, tools,
grammar and reasoning split), and its answer built into output items
(infer.server.responses_output), in one body or as typed stream events. `previous_response_id`
continues a response kept in the server's memory (infer.server.responses_store); an unknown id
is a 400 with code previous_response_not_found and param previous_response_id, as OpenAI answers
it. A client that hangs up aborts its request, as on the chat route.
"""

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from infer.engine.output_processor import StepOutput
from infer.server import errors
from infer.server.chat_output import finish_reason
from infer.server.chat_run import prepare_chat
from infer.server.engine_loop import RequestHandle
from infer.server.errors import CLIENT_CLOSED_REQUEST, ApiError, parse_request
from infer.server.generation import EventStreamResponse, collect, submit, unfinished_error
from infer.server.limits import read_body
from infer.server.responses_chat import chat_request
from infer.server.responses_output import ResponseBuilder, new_id
from infer.server.responses_request import ResponsesRequest
from infer.server.responses_store import ResponseStore, StoredResponse
from infer.server.server_state import ServerState

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    server: ServerState = request.app.state.server
    body = parse_request(ResponsesRequest, await read_body(request, server.limits.max_request_bytes))
    model = await server.model_for(request, body.model)
    store = _store(request.app)
    previous = None
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise ApiError(
                400,
                f"Previous response with id {body.previous_response_id!r} not found: it was never stored "
                "here (store: false), or the server restarted or dropped it (it keeps the most recent "
                f"{store.max_responses}); send the whole conversation in input",
                errors.INVALID_REQUEST,
                "previous_response_id",
                "previous_response_not_found",
            )
    reading = chat_request(body, previous.conversation() if previous is not None else [])
    try:
        prepared = await prepare_chat(model, reading.request)
    except ApiError as error:
        raise reading.responses_error(error) from None
    response_id = new_id("resp")
    server.require_ready()  # again: the server may have begun draining meanwhile
    engine_loop = model.engine_loop
    (handle,) = submit(
        engine_loop,
        [(prepared.prompt.ids, prepared.params)],
        response_id,
        "input",
        images=prepared.prompt.images,
    )
    builder = ResponseBuilder(_echo(body, response_id), prepared.output_parsers[0])
    answer = _Answer(
        builder,
        handle,
        store if body.store else None,
        previous,
        body.input_items(),
        report_cached=model.engine.config.use_prefix_caching,
    )
    if body.stream:
        return EventStreamResponse(answer.events(), engine_loop, [handle])
    collected = await collect(request, engine_loop, [handle])
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    builder.start()
    for output in collected[0].outputs[:-1]:
        builder.feed(output.text_delta, output.token_id is not None)
    answer.finish(collected[0].final)
    return JSONResponse(builder.response)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    stored = _store(request.app).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    if not _store(request.app).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class _Answer:
    """One response's run: its events as the engine's outputs come, its end, its storing."""

    def __init__(
        self,
        builder: ResponseBuilder,
        handle: RequestHandle,
        store: ResponseStore | None,
        previous: StoredResponse | None,
        input_items: list[Any],
        *,
        report_cached: bool,
    ):
        self.builder, self.handle, self.store = builder, handle, store
        self.previous, self.input_items = previous, input_items
        self.report_cached = report_cached

    async def events(self) -> AsyncIterator[bytes]:
        # Output by output, not caught up in one step as the chat stream does when it falls
        # behind: each token's text is read as the body reads it, so the reasoning tokens count
        # the same streamed or not.
        for event in self.builder.start():
            yield _sse(event)
        while not (output := await self.handle.outputs.get()).finished:
            for event in self.builder.feed(output.text_delta, output.token_id is not None):
                yield _sse(event)
        error = unfinished_error(self.handle, output)
        if error is not None:
            for event in self.builder.failed(error):
                yield _sse(event)
            return
        for event in self.finish(output):
            yield _sse(event)

    def finish(self, final: StepOutput) -> list[dict[str, Any]]:
        """The closing events, from the final output (its own text included); the response is
        stored when the client asked. A body's unfinished choice raised in `collect` already."""
        events = self.builder.feed(final.text_delta, final.token_id is not None)
        events += self.builder.finish(
            final.finish_reason,
            input_tokens=final.prompt_tokens,
            output_tokens=final.completion_tokens,
            cached_tokens=final.cached_tokens if self.report_cached else 0,
        )
        num_calls = sum(item["type"] == "function_call" for item in self.builder.output)
        self.handle.answered(finish_reason(final.finish_reason, num_calls))
        if self.store is not None:
            self.store.put(StoredResponse(self.builder.response, self.input_items, self.previous))
        return events


def _sse(event: dict[str, Any]) -> bytes:
    """One typed event: its type on the `event:` line, as OpenAI sends them, and in the data."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _echo(body: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object's fields, in OpenAI's order, with what the request set echoed."""
    text_format = body.text.format if body.text is not None else None
    reasoning = body.reasoning
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "model": body.model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning is not None else None,
            "summary": reasoning.summary if reasoning is not None else None,
        },
        "store": body.store,
        "temperature": body.temperature,
        "text": {
            "format": (
                text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format is not None
                else {"type": "text"}
            )
        },
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [_echo_tool(tool) for tool in body.tools or []],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def _store(app: FastAPI) -> ResponseStore:
    """The app's store, made on first use (one per app: a server's responses are its own)."""
    store = getattr(app.state, "response_store", None)
    if store is None:
        store = app.state.response_store = ResponseStore()
    return store


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no response with id {response_id!r} is stored here (store: false, a restart, or dropped as "
        "the oldest)",
        errors.INVALID_REQUEST,
        "response_id",
        "not_found",
    )
