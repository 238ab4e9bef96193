"""POST /v1/completions: one prompt (text or token ids), `n` choices, streamed or in one body."""

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infer.server import responses
from infer.server.errors import parse_request
from infer.server.generation import (
    EventStreamResponse,
    answer_events,
    choice_events,
    collect,
    sampling_params,
    submit,
    total_usage,
)
from infer.server.limits import check_prompt_chars, read_body
from infer.server.schemas import CompletionRequest
from infer.server.server_state import ServerState
from infer.server.sse import CompletionStream

router = APIRouter()

# Status of a response nobody receives (nginx's "client closed request"); only the logs see it.
CLIENT_CLOSED_REQUEST = 499


def _document_start_id(tokenizer) -> int:
    """What an empty text prompt starts from: the BOS token if the tokenizer declares one, else
    its EOS token (GPT-2-style models begin unconditional text after an end-of-document)."""
    bos = tokenizer.hf_tokenizer.bos_token_id
    return bos if bos is not None else tokenizer.eos_token_id


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    server: ServerState = request.app.state.server
    body = parse_request(CompletionRequest, await read_body(request, server.limits.max_request_bytes))
    engine_loop = server.require_ready()
    server.check_model(body.model)
    if isinstance(body.prompt, str):
        check_prompt_chars(len(body.prompt), server.max_prompt_chars, "prompt")
        # A plain-text prompt gets the tokenizer's special tokens (BOS), as the engine's own
        # add_request and `infer generate` do; token-id prompts are taken as they are.
        prompt_ids = await run_in_threadpool(
            server.engine.tokenizer.encode, body.prompt, add_special_tokens=True
        )
        if not prompt_ids:  # prompt "" on a tokenizer that adds no BOS: start a new document
            prompt_ids = [_document_start_id(server.engine.tokenizer)]
    else:
        prompt_ids = list(body.prompt)
    params = sampling_params(body, len(prompt_ids), server.max_model_len, prompt_field="prompt")
    request_id, created = responses.new_request_id("cmpl"), int(time.time())
    handles = submit(engine_loop, prompt_ids, params, request_id, prompt_field="prompt", n=body.n)
    if body.stream:
        streams = [
            CompletionStream(request_id, created, body.model, include_usage=body.include_usage, index=index)
            for index in range(body.n)
        ]
        choices = [choice_events(handle, stream) for handle, stream in zip(handles, streams, strict=True)]
        events = answer_events(choices, handles, streams[0] if body.include_usage else None)
        return EventStreamResponse(events, engine_loop, handles)
    collected = await collect(request, engine_loop, handles)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    usage = total_usage([choice.final for choice in collected])
    bodies = [
        responses.completion(
            request_id,
            created,
            body.model,
            choice.text,
            choice.final.finish_reason,
            usage,
            choice.token_ids,
            index=index,
        )
        for index, choice in enumerate(collected)
    ]
    return JSONResponse(responses.merge_choices(bodies, usage))
