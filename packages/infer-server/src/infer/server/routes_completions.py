"""POST /v1/completions: a prompt (text or token ids) or a batch of them, `n` choices each,
streamed or in one body; with `echo` each choice's text starts with its prompt's (and its
`logprobs` with the prompt's tokens; `max_tokens: 0` answers the prompt alone), and vLLM's
`prompt_logprobs` gives each choice its prompt's (infer.server.logprobs has both shapes)."""

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infer.server import responses
from infer.server.errors import CLIENT_CLOSED_REQUEST, parse_request
from infer.server.generation import (
    Collected,
    EventStreamResponse,
    answer_events,
    choice_events,
    collect,
    sampling_params,
    submit,
    total_usage,
)
from infer.server.limits import check_prompt_chars, read_body
from infer.server.logprobs import ChoiceLogprobs, prompt_logprobs_field
from infer.server.schemas import CompletionRequest
from infer.server.served_models import ServedModel
from infer.server.server_state import ServerState
from infer.server.sse import CompletionStream

router = APIRouter()


def _document_start_id(tokenizer) -> int:
    """What an empty text prompt starts from: the BOS token if the tokenizer declares one, else
    its EOS token (GPT-2-style models begin unconditional text after an end-of-document)."""
    bos = tokenizer.hf_tokenizer.bos_token_id
    return bos if bos is not None else tokenizer.eos_token_id


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    server: ServerState = request.app.state.server
    body = parse_request(CompletionRequest, await read_body(request, server.limits.max_request_bytes))
    model = await server.model_for(request, body.model)
    engine_loop = model.engine_loop
    prompts_ids = [await _prompt_ids(model, prompt) for prompt in body.prompts]
    # One SamplingParams per prompt: the default token limit is what each prompt's context leaves.
    params = [
        sampling_params(body, len(prompt_ids), model.max_model_len, prompt_field="prompt")
        for prompt_ids in prompts_ids
    ]
    echoes = [
        await _echo_text(model, prompt, prompt_ids) if body.echo else ""
        for prompt, prompt_ids in zip(body.prompts, prompts_ids, strict=True)
    ]
    request_id, created = responses.new_request_id("cmpl"), int(time.time())
    # Choices in OpenAI's order: prompt by prompt, n per prompt; all queued or none.
    prompts = list(zip(prompts_ids, params, strict=True))
    handles = submit(
        engine_loop, prompts, request_id, prompt_field="prompt", n=body.n, cache_salt=body.cache_salt
    )
    report_cached = model.engine.config.use_prefix_caching
    choice_echoes = [echo for echo in echoes for _ in range(body.n)]
    choice_logprobs = [
        ChoiceLogprobs(model.engine.tokenizer, chat=False) if body.logprobs is not None else None
        for _ in handles
    ]
    if body.stream:
        streams = [
            CompletionStream(request_id, created, body.model, include_usage=body.include_usage, index=index)
            for index in range(len(handles))
        ]
        choices = [
            choice_events(handle, stream, prefix=echo, logprobs=logprobs)
            for handle, stream, echo, logprobs in zip(
                handles, streams, choice_echoes, choice_logprobs, strict=True
            )
        ]
        usage_stream = streams[0] if body.include_usage else None
        events = answer_events(
            choices, handles, usage_stream, choices_per_prompt=body.n, report_cached=report_cached
        )
        return EventStreamResponse(events, engine_loop, handles)
    collected = await collect(request, engine_loop, handles)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if body.answers_prompt_only:
        # The one token each ran is not part of the answer.
        collected = [Collected("", final=choice.final, outputs=choice.outputs) for choice in collected]
    usage = total_usage(
        [choice.final for choice in collected], choices_per_prompt=body.n, report_cached=report_cached
    )
    if body.answers_prompt_only:
        usage = responses.usage(
            usage["prompt_tokens"], 0, usage.get("prompt_tokens_details", {}).get("cached_tokens")
        )
    choice_prompt_ids = [prompt_ids for prompt_ids in prompts_ids for _ in range(body.n)]
    bodies = []
    for index, (choice, echo, logprobs, prompt_ids) in enumerate(
        zip(collected, choice_echoes, choice_logprobs, choice_prompt_ids, strict=True)
    ):
        completion = responses.completion(
            request_id,
            created,
            body.model,
            echo + choice.text,
            "length" if body.answers_prompt_only else choice.final.finish_reason,
            usage,
            choice.token_ids,
            index=index,
            logprobs=_choice_logprobs(body, logprobs, choice, prompt_ids),
        )
        if body.prompt_logprobs is not None:
            tokenizer = model.engine.tokenizer
            scored = choice.prompt_logprobs
            completion["choices"][0]["prompt_logprobs"] = await run_in_threadpool(
                prompt_logprobs_field, tokenizer, prompt_ids, scored, body.prompt_logprobs
            )
        bodies.append(completion)
    return JSONResponse(responses.merge_choices(bodies, usage))


def _choice_logprobs(
    body: CompletionRequest, logprobs: ChoiceLogprobs | None, choice: Collected, prompt_ids: list[int]
) -> dict | None:
    """A choice's `logprobs`: its tokens', after its prompt's with echo."""
    if logprobs is None:
        return None
    if body.echo:
        return logprobs.render_echoed(
            prompt_ids, choice.prompt_logprobs, choice.token_ids, choice.logprobs, body.logprobs
        )
    return logprobs.render(choice.token_ids, choice.logprobs)


async def _prompt_ids(model: ServedModel, prompt: str | list[int]) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    check_prompt_chars(len(prompt), model.max_prompt_chars, "prompt")
    # A plain-text prompt gets the tokenizer's special tokens (BOS), as the engine's own
    # add_request and `infer generate` do; token-id prompts are taken as they are.
    prompt_ids = await run_in_threadpool(model.engine.tokenizer.encode, prompt, add_special_tokens=True)
    if not prompt_ids:  # prompt "" on a tokenizer that adds no BOS: start a new document
        prompt_ids = [_document_start_id(model.engine.tokenizer)]
    return prompt_ids


async def _echo_text(model: ServedModel, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """What `echo` puts before the completion: the prompt as sent, or its token ids' text."""
    if isinstance(prompt, str):
        return prompt
    return await run_in_threadpool(model.engine.tokenizer.decode, prompt_ids)
