"""POST /v1/chat/completions: messages (and tools) rendered by the model's chat template (ours,
never transformers' apply_chat_template), tokenized once (infer.server.chat_prompt, which
/tokenize shares) and submitted (infer.server.chat_run, which /v1/messages shares); the answer
streamed or in one body.

The prompt tokens of `usage` are exactly the tokens fed to the model (with a forced tool call,
the call's opening written for the model included). Generation ends at the template's
end-of-turn token, which is in the engine's EOS set (infer.engine.eos).

Images (image_url parts, for a model with a vision tower) are decoded and preprocessed before
the template renders, each template marker is widened into the image's placeholder tokens, and
the engine gets each image over its run (infer.server.chat_images).

With tools in play (infer.server.chat_tools) the answer is read for the family's tool calls
(infer.server.tool_parsers); for Qwen 3 with thinking on, `<think>` text becomes
`reasoning_content` (infer.server.reasoning). Otherwise the text is the content, untouched.
"""

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infer.server import responses
from infer.server.chat_output import finish_reason
from infer.server.chat_run import start_chat
from infer.server.errors import CLIENT_CLOSED_REQUEST, parse_request
from infer.server.generation import (
    EventStreamResponse,
    answer_events,
    choice_events,
    collect,
    parsed_choice_events,
    total_usage,
)
from infer.server.limits import read_body
from infer.server.logprobs import ChoiceLogprobs, prompt_logprobs_field
from infer.server.schemas import ChatCompletionRequest
from infer.server.server_state import ServerState
from infer.server.sse import ChatStream

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    server: ServerState = request.app.state.server
    body = parse_request(ChatCompletionRequest, await read_body(request, server.limits.max_request_bytes))
    model = await server.model_for(request, body.model)
    request_id, created = responses.new_request_id("chatcmpl"), int(time.time())
    run = await start_chat(server, model, body, request_id)
    engine_loop, handles, chat_outputs = run.engine_loop, run.handles, run.output_parsers
    report_cached = model.engine.config.use_prefix_caching
    choice_logprobs = [
        ChoiceLogprobs(model.engine.tokenizer, chat=True) if body.logprobs else None for _ in handles
    ]
    if body.stream:
        choices = []
        for index, (handle, chat_output, logprobs) in enumerate(
            zip(handles, chat_outputs, choice_logprobs, strict=True)
        ):
            stream = ChatStream(
                request_id, created, body.model, include_usage=body.include_usage, index=index
            )
            if chat_output is None:
                choices.append(choice_events(handle, stream, logprobs=logprobs))
            else:
                choices.append(parsed_choice_events(handle, stream, chat_output, logprobs))
        usage_stream = ChatStream(request_id, created, body.model) if body.include_usage else None
        events = answer_events(choices, handles, usage_stream, report_cached=report_cached)
        return EventStreamResponse(events, engine_loop, handles)
    collected = await collect(request, engine_loop, handles)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    usage = total_usage([choice.final for choice in collected], report_cached=report_cached)
    bodies = []
    for index, (choice, logprobs, handle) in enumerate(zip(collected, choice_logprobs, handles, strict=True)):
        answer = run.answer(index, choice.text)
        tool_calls = [
            responses.tool_call(responses.new_tool_call_id(), call.name, call.arguments)
            for call in answer.tool_calls
        ]
        reason = finish_reason(choice.final.finish_reason, len(tool_calls))
        handle.answered(reason)
        bodies.append(
            responses.chat_completion(
                request_id,
                created,
                body.model,
                answer.content,
                reason,
                usage,
                tool_calls=tool_calls,
                token_ids=choice.token_ids,
                reasoning_content=answer.reasoning_content,
                index=index,
                logprobs=logprobs.render(choice.token_ids, choice.logprobs) if logprobs is not None else None,
            )
        )
    answer = responses.merge_choices(bodies, usage)
    if body.prompt_logprobs is not None:
        # vLLM's place for them: the response's, as the choices share the prompt.
        answer["prompt_logprobs"] = await run_in_threadpool(
            prompt_logprobs_field,
            model.engine.tokenizer,
            run.prompt.ids,
            collected[0].prompt_logprobs,
            body.prompt_logprobs,
        )
    return JSONResponse(answer)
