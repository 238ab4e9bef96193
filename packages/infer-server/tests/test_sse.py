"""The fast SSE encoder writes exactly the bytes json.dumps would, and the OpenAI client reads
our streams."""

import json

import httpx
import openai
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from infer.server import responses
from infer.server.errors import ApiError
from infer.server.sse import DONE, ChatStream, CompletionStream, error_event, event


def reference_event(chunk) -> bytes:
    # Written out again (not sse.event) so the oracle is the spec's formula itself.
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# Any code point but the surrogates, which have no UTF-8 encoding (tested on their own below).
any_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]))
token_ids = st.none() | st.lists(st.integers(min_value=0, max_value=2**31), max_size=4)
TRICKY = [
    "".join(map(chr, range(0x20))) + "\x7f",  # every control character, and DEL
    '"quoted" \\back\\slash\\ "',
    "\u2028line\u2029paragraph",  # valid in JSON, not in JS: json.dumps leaves them; so must we
    "caf\u00e9 \u65e5\u672c \U0001f600 e\u0301",  # 2-, 3- and 4-byte UTF-8, a combining accent
    "</script>{}[],:",
    "",
]


@given(text=any_text, ids=token_ids, model=any_text, request_id=any_text, include_usage=st.booleans())
@example(text=TRICKY[0], ids=None, model="m", request_id="chatcmpl-1", include_usage=False)
@example(text=TRICKY[1], ids=[1], model='"m"', request_id="\\", include_usage=True)
@example(text=TRICKY[2], ids=None, model="m", request_id="x", include_usage=False)
@example(text=TRICKY[3], ids=[0, 2**31], model="\u2028", request_id="x", include_usage=True)
@example(text=TRICKY[4], ids=[], model="m", request_id="x", include_usage=False)
@example(text=TRICKY[5], ids=None, model="", request_id="", include_usage=False)
def test_chat_content_chunk_is_byte_identical_to_json_dumps(text, ids, model, request_id, include_usage):
    stream = ChatStream(request_id, 1_700_000_000, model, include_usage=include_usage)
    chunk = responses.chat_chunk(
        request_id, 1_700_000_000, model, {"content": text}, None, ids, include_usage=include_usage
    )
    assert stream.content(text, ids) == reference_event(chunk)


@given(text=any_text, ids=token_ids, model=any_text, request_id=any_text, include_usage=st.booleans())
@example(text=TRICKY[0], ids=None, model="m", request_id="chatcmpl-1", include_usage=False)
@example(text=TRICKY[1], ids=[1], model='"m"', request_id="\\", include_usage=True)
@example(text=TRICKY[3], ids=[0, 2**31], model="\u2028", request_id="x", include_usage=True)
@example(text=TRICKY[5], ids=[], model="", request_id="", include_usage=False)
def test_chat_reasoning_chunk_is_byte_identical_to_json_dumps(text, ids, model, request_id, include_usage):
    stream = ChatStream(request_id, 1_700_000_000, model, include_usage=include_usage)
    chunk = responses.chat_chunk(
        request_id, 1_700_000_000, model, {"reasoning_content": text}, None, ids, include_usage=include_usage
    )
    assert stream.reasoning(text, ids) == reference_event(chunk)


@given(
    index=st.integers(min_value=0, max_value=64),
    call_id=any_text,
    name=any_text,
    arguments=any_text,
    ids=token_ids,
    include_usage=st.booleans(),
)
@example(
    index=0,
    call_id="call_1",
    name="get_weather",
    arguments='{"city": "Par\\"is"}',
    ids=None,
    include_usage=False,
)
@example(index=3, call_id=TRICKY[2], name=TRICKY[3], arguments=TRICKY[0], ids=[5], include_usage=True)
def test_chat_tool_call_chunk_is_the_openai_streaming_delta(
    index, call_id, name, arguments, ids, include_usage
):
    stream = ChatStream("chatcmpl-1", 9, "m", include_usage=include_usage)
    delta = {
        "tool_calls": [
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        ]
    }
    chunk = responses.chat_chunk("chatcmpl-1", 9, "m", delta, None, ids, include_usage=include_usage)
    assert stream.tool_call(index, call_id, name, arguments, ids) == reference_event(chunk)


@given(text=any_text, ids=token_ids, model=any_text, include_usage=st.booleans())
@example(text=TRICKY[0], ids=[7], model="m", include_usage=True)
@example(text=TRICKY[2], ids=None, model="m", include_usage=False)
def test_completion_text_chunk_is_byte_identical_to_json_dumps(text, ids, model, include_usage):
    stream = CompletionStream("cmpl-1", 3, model, include_usage=include_usage)
    chunk = responses.completion_chunk("cmpl-1", 3, model, text, None, ids, include_usage=include_usage)
    assert stream.text(text, ids) == reference_event(chunk)


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb"])
def test_a_lone_surrogate_fails_like_json_dumps_then_encode(text):
    chunk = responses.chat_chunk("x", 0, "m", {"content": text})
    with pytest.raises(UnicodeEncodeError):
        reference_event(chunk)
    with pytest.raises(UnicodeEncodeError):
        ChatStream("x", 0, "m").content(text)


def test_rare_chunks_are_the_builders_chunks():
    stream = ChatStream("chatcmpl-1", 5, "m", include_usage=True)
    assert stream.role() == reference_event(
        responses.chat_chunk("chatcmpl-1", 5, "m", {"role": "assistant", "content": ""}, include_usage=True)
    )
    assert stream.finish("length") == reference_event(
        responses.chat_chunk("chatcmpl-1", 5, "m", {}, "length", include_usage=True)
    )
    usage = responses.usage(3, 4)
    assert stream.usage(usage) == reference_event(
        responses.usage_chunk("chat.completion.chunk", "chatcmpl-1", 5, "m", usage)
    )


def test_error_event_and_terminator():
    error = ApiError(500, "engine step failed", "server_error", None, "internal_error")
    assert error_event(error) == reference_event(error.body())
    assert event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def sse_response(events: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(events))


PIECES = ["Paris", " is", " the", ' "capital"', "\n\u2028", " \U0001f600"]


def test_openai_client_reads_a_chat_stream_with_usage(openai_client_answering):
    stream = ChatStream("chatcmpl-abc", 1_700_000_000, "smollm2", include_usage=True)
    events = [stream.role()]
    events += [stream.content(piece, [index]) for index, piece in enumerate(PIECES)]
    events += [
        stream.finish("stop"),
        stream.usage(responses.usage(12, len(PIECES), cached_prompt_tokens=0)),
        DONE,
    ]
    client = openai_client_answering(lambda request: sse_response(events))

    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Capital of France?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == "".join(
        PIECES
    )
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert (
        chunks[-1].usage.prompt_tokens,
        chunks[-1].usage.completion_tokens,
        chunks[-1].usage.total_tokens,
    ) == (
        12,
        len(PIECES),
        12 + len(PIECES),
    )
    assert chunks[1].choices[0].model_extra["token_ids"] == [0]
    assert {chunk.id for chunk in chunks} == {"chatcmpl-abc"}


def test_openai_client_reads_reasoning_and_tool_call_chunks(openai_client_answering):
    stream = ChatStream("chatcmpl-abc", 1_700_000_000, "qwen3")
    events = [
        stream.role(),
        stream.reasoning("Need the ", [1]),
        stream.reasoning("weather.", [2]),
        stream.content("Checking.", [3]),
        stream.tool_call(0, "call_a", "get_weather", '{"city": "Paris"}', [4, 5]),
        stream.tool_call(1, "call_b", "get_weather", '{"city": "Rome"}', [6]),
        stream.finish("tool_calls"),
        DONE,
    ]
    client = openai_client_answering(lambda request: sse_response(events))

    chunks = list(
        client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "Weather?"}], stream=True
        )
    )

    deltas = [chunk.choices[0].delta for chunk in chunks]
    reasoning = "".join(delta.model_extra.get("reasoning_content") or "" for delta in deltas)
    assert reasoning == "Need the weather."
    assert "".join(delta.content or "" for delta in deltas) == "Checking."
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert [(c.index, c.id, c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "call_a", "function", "get_weather", {"city": "Paris"}),
        (1, "call_b", "function", "get_weather", {"city": "Rome"}),
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_client_reads_a_completion_stream(openai_client_answering):
    stream = CompletionStream("cmpl-abc", 1_700_000_000, "smollm2")
    events = [stream.text(piece) for piece in PIECES[:-1]] + [stream.finish("length", PIECES[-1]), DONE]
    client = openai_client_answering(lambda request: sse_response(events))

    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France", stream=True))

    assert "".join(chunk.choices[0].text for chunk in chunks) == "".join(PIECES)
    assert [chunk.choices[0].finish_reason for chunk in chunks] == [None] * (len(PIECES) - 1) + ["length"]


def test_openai_client_raises_on_an_error_event_mid_stream(openai_client_answering):
    stream = ChatStream("chatcmpl-abc", 0, "m")
    error = ApiError(500, "engine step failed", "server_error", None, "internal_error")
    events = [stream.role(), stream.content("Par"), error_event(error), DONE]
    client = openai_client_answering(lambda request: sse_response(events))

    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "?"}], stream=True
        ):
            received.append(chunk)
    assert len(received) == 2
    assert caught.value.message == "engine step failed"
    assert caught.value.code == "internal_error"
