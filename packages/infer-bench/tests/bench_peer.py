"""A small real OpenAI-compatible streaming server for the benchmark client's tests.

Not a model: each request streams `max_tokens` chunks ("t0 ", "t1 ", ...), the first after
`first_token_delay_s` and the rest `token_delay_s` apart, then a usage chunk and [DONE], in
OpenAI's SSE format. It records what it received and the most requests it had in flight, so the
tests can check the client's timings and concurrency against what really happened.

A chat prompt's tokens are its messages' words, plus `preamble_tokens` (what a chat template
may add to every prompt unseen by the client, e.g. a default system header). With `prefix_cache`
it plays a prefix cache of whole messages: a chat request whose messages start with all of an
earlier request's is served that request's prompt tokens from the "cache"
(`usage.prompt_tokens_details.cached_tokens`, the largest such), and /metrics counts admissions
as `infer_prefix_cache_matches_total{kind="prefix"}` or `{kind="miss"}`, as our server does.

Run alone (what `infer bench matrix` starts in its test):
    python bench_peer.py --engine-config FILE --host 127.0.0.1 --port P [--token-delay-s S]
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def _num_words(content: str | list[dict]) -> int:
    """A message's words: its text, or its text parts' (image parts count none)."""
    if isinstance(content, str):
        return len(content.split())
    return sum(len(part["text"].split()) for part in content if part["type"] == "text")


def create_peer_app(
    model: str = "peer-model",
    *,
    first_token_delay_s: float = 0.02,
    token_delay_s: float = 0.005,
    reject_ignore_eos: bool = False,
    preamble_tokens: int = 0,
    prefix_cache: bool = False,
    hold_until_in_flight: int = 0,
) -> FastAPI:
    """`hold_until_in_flight`: each stream waits before its first token until that many requests
    have been in flight at once (or 5 s have passed), so that whether a client sends them together
    shows in `max_in_flight` whatever the machine's load."""
    app = FastAPI()
    state = {"received": [], "in_flight": 0, "max_in_flight": 0, "queue_time_sum": 0.0, "queue_time_count": 0}
    # The prefix cache: every chat prompt so far, as (messages, prompt tokens); admissions by kind.
    state["cached_prompts"] = []
    state["matches"] = {"miss": 0, "prefix": 0, "lcp": 0}
    app.state.peer = state

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
        return JSONResponse(body, status_code=status)

    async def generate(request: Request, chat: bool):
        body = await request.json()
        if reject_ignore_eos and "ignore_eos" in body:
            return error(422, "ignore_eos: extra inputs are not permitted", "ignore_eos")
        if body.get("model") != model:
            return error(404, f"model {body.get('model')!r} is not served here", "model")
        state["received"].append(body)
        num_tokens = body["max_tokens"]
        num_cached_tokens = None
        if chat:
            messages = body["messages"]
            num_prompt_tokens = preamble_tokens + sum(_num_words(m["content"]) for m in messages)
            if prefix_cache:
                num_cached_tokens = max(
                    (n for earlier, n in state["cached_prompts"] if messages[: len(earlier)] == earlier),
                    default=0,
                )
                state["matches"]["prefix" if num_cached_tokens else "miss"] += 1
                state["cached_prompts"].append((messages, num_prompt_tokens))
        else:
            num_prompt_tokens = len(body["prompt"])
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            payload = {
                "id": "peer-1",
                "object": kind,
                "created": 0,
                "model": model,
                "choices": [choice],
                "usage": None,
            }
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                if chat:
                    yield chunk(None, role=True)
                deadline = time.monotonic() + 5
                while state["max_in_flight"] < hold_until_in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(first_token_delay_s)
                state["queue_time_sum"] += first_token_delay_s
                state["queue_time_count"] += 1
                for i in range(num_tokens):
                    if i:
                        await asyncio.sleep(token_delay_s)
                    yield chunk(f"t{i} ")
                yield chunk(None, finish="length")
                usage = {
                    "prompt_tokens": num_prompt_tokens,
                    "completion_tokens": num_tokens,
                    "total_tokens": num_prompt_tokens + num_tokens,
                }
                if num_cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
                payload = {
                    "id": "peer-1",
                    "object": kind,
                    "created": 0,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield b"data: " + json.dumps(payload).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "peer"}],
        }

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        lines = [
            "# TYPE infer_kv_cache_used_bytes gauge",
            f"infer_kv_cache_used_bytes {1000 * state['in_flight']}",
            "# TYPE infer_kv_cache_total_bytes gauge",
            "infer_kv_cache_total_bytes 65536",
            "# TYPE infer_request_queue_time_seconds histogram",
            f'infer_request_queue_time_seconds_bucket{{le="+Inf"}} {state["queue_time_count"]}',
            f"infer_request_queue_time_seconds_sum {state['queue_time_sum']}",
            f"infer_request_queue_time_seconds_count {state['queue_time_count']}",
        ]
        if prefix_cache:
            lines.append("# TYPE infer_prefix_cache_matches_total counter")
            lines += [
                f'infer_prefix_cache_matches_total{{kind="{k}"}} {n}' for k, n in state["matches"].items()
            ]
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-config", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    model = json.loads(args.engine_config.read_text())["model"]
    app = create_peer_app(model, first_token_delay_s=args.token_delay_s, token_delay_s=args.token_delay_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
