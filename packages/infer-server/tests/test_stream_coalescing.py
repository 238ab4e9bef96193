"""A streamed choice sends a chunk per token while it keeps up, and catches up in one chunk when
tokens queued up behind it (a busy server): same text, same tokens, fewer events."""

import asyncio
import json

import pytest

from infer.engine.output_processor import StepOutput
from infer.server.engine_loop import RequestHandle
from infer.server.generation import choice_events
from infer.server.sse import ChatStream, CompletionStream

PIECES = ["Hel", "lo", ",", " wor", "ld"]


def step_output(index: int, *, finished: bool = False) -> StepOutput:
    return StepOutput(
        "r",
        100 + index,
        PIECES[index],
        finished,
        "length" if finished else None,
        None,
        prompt_tokens=3,
        completion_tokens=index + 1,
    )


def chunks(events: list[bytes]) -> list[dict]:
    return [json.loads(event.removeprefix(b"data: ")) for event in events]


async def stream(make_stream, *, behind: bool) -> list[dict]:
    """The chunks of one choice whose outputs come one at a time (the stream keeps up), or are all
    queued before it reads (it fell behind)."""
    handle = RequestHandle("r", 0.0)
    events = choice_events(handle, make_stream())
    outputs = [step_output(i, finished=i == len(PIECES) - 1) for i in range(len(PIECES))]
    received = []
    if behind:
        for output in outputs:
            handle.outputs.put_nowait(output)
        received = [event async for event in events]
    else:

        async def feed():
            for output in outputs:
                handle.outputs.put_nowait(output)
                await asyncio.sleep(0.01)

        feeder = asyncio.ensure_future(feed())
        received = [event async for event in events]
        await feeder
    return chunks(received)


def completion_stream():
    return CompletionStream("cmpl-1", 0, "m")


def chat_stream():
    return ChatStream("chatcmpl-1", 0, "m")


def text_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


@pytest.mark.parametrize("make_stream", [completion_stream, chat_stream], ids=["completions", "chat"])
def test_a_stream_that_keeps_up_sends_a_chunk_per_token(make_stream):
    got = asyncio.run(stream(make_stream, behind=False))
    texts = [text_of(chunk) for chunk in got if text_of(chunk)]
    assert texts == PIECES
    assert got[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("make_stream", [completion_stream, chat_stream], ids=["completions", "chat"])
def test_a_stream_that_fell_behind_catches_up_in_one_chunk(make_stream):
    got = asyncio.run(stream(make_stream, behind=True))
    texts = [text_of(chunk) for chunk in got if text_of(chunk)]
    assert texts == ["".join(PIECES)]
    assert len([chunk for chunk in got if chunk["choices"][0]["finish_reason"]]) == 1
    assert got[-1]["choices"][0]["finish_reason"] == "length"
