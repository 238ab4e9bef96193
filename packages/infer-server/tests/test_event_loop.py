"""The HTTP server's event loop (`infer serve --event-loop`): uvloop where it is installed, which
infer-server depends on, else Python's asyncio; either serves the same streamed answers."""

import asyncio

import pytest

from infer.server.serve import BackgroundServer

from .conftest import SERVED_MODEL

MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]


def streamed_answer(base_url: str) -> str:
    import openai

    client = openai.OpenAI(api_key="unused", base_url=f"{base_url}/v1", max_retries=0, timeout=60.0)
    chunks = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def served_with(make_engine, event_loop: str) -> tuple[type, str]:
    """(the class of the loop the app ran on, the greedy streamed answer)."""
    server = BackgroundServer(
        make_engine(max_batch_size=2),
        served_model_name=SERVED_MODEL,
        log_level="warning",
        event_loop=event_loop,
    )
    try:
        loop_class = type(server.state.models.default.engine_loop._loop)
        return loop_class, streamed_answer(server.base_url)
    finally:
        server.stop()


def test_auto_runs_uvloop_and_asyncio_serves_the_same_answer(make_engine):
    uvloop = pytest.importorskip("uvloop")
    auto_loop, auto_answer = served_with(make_engine, "auto")
    asyncio_loop, asyncio_answer = served_with(make_engine, "asyncio")
    assert issubclass(auto_loop, uvloop.Loop)
    assert not issubclass(asyncio_loop, uvloop.Loop) and issubclass(asyncio_loop, asyncio.BaseEventLoop)
    assert auto_answer and auto_answer == asyncio_answer
