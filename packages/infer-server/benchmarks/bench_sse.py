"""Nanoseconds per streamed token: our SSE chunk encoder against json.dumps of the whole chunk.

    python packages/infer-server/benchmarks/bench_sse.py          # the table in docs/benchmarks/sse.md
    pytest packages/infer-server/benchmarks/bench_sse.py --benchmark-only   # pytest-benchmark

Not collected by the default test run (the file name does not match test_*.py).
Baselines, measured in the same run: `json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)`
as a server would write it (a new JSONEncoder per call), and the same with one reused JSONEncoder.
"""

import json
import platform
import sys
import time
import timeit

import pytest

from infer.server import responses
from infer.server.sse import ChatStream

ID, CREATED, MODEL = "chatcmpl-0123456789abcdef0123456789abcdef", 1_700_000_000, "smollm2-135m-instruct"
# Token texts as a detokenizer hands them out: mostly short ASCII pieces, some that need escaping.
TOKENS = {
    "ascii": [" the", " capital", " of", " France", " is", " Paris", ".", "\n"],
    "escapes": ['"', "\\", "\n\n", "\t", ' "quote"'],
    "non-ascii": [" caf\u00e9", "\u65e5\u672c", " \U0001f600", "\u2028", " na\u00efve"],
}
REUSED_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def encode_fast(stream: ChatStream, texts: list[str]) -> list[bytes]:
    return [stream.content(text) for text in texts]


def encode_json_dumps(texts: list[str]) -> list[bytes]:
    out = []
    for text in texts:
        chunk = responses.chat_chunk(ID, CREATED, MODEL, {"content": text})
        out.append(
            b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        )
    return out


def encode_reused_encoder(texts: list[str]) -> list[bytes]:
    out = []
    for text in texts:
        chunk = responses.chat_chunk(ID, CREATED, MODEL, {"content": text})
        out.append(b"data: " + REUSED_ENCODER.encode(chunk).encode() + b"\n\n")
    return out


def ns_per_token(function, texts: list[str], repeat: int = 11) -> float:
    calls = max(1, 50_000 // len(texts))
    # CPU time of this process, not wall time: on a shared machine, time spent descheduled is not ours.
    best = min(timeit.repeat(lambda: function(texts), number=calls, repeat=repeat, timer=time.process_time))
    return best / (calls * len(texts)) * 1e9


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    stream = ChatStream(ID, CREATED, MODEL)
    print(f"CPU: {cpu_name()}; Python {sys.version.split()[0]} ({platform.python_implementation()})")
    print(
        "chat.completion.chunk, one content delta; CPU ns per token (best of 11); ratio = json.dumps / ours"
    )
    print("| token texts | ours (ns) | json.dumps (ns) | reused JSONEncoder (ns) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, texts in TOKENS.items():
        assert encode_fast(stream, texts) == encode_json_dumps(
            texts
        )  # same bytes, or the numbers mean nothing
        ours = ns_per_token(lambda t: encode_fast(stream, t), texts)
        dumps = ns_per_token(encode_json_dumps, texts)
        reused = ns_per_token(encode_reused_encoder, texts)
        print(f"| {name} | {ours:.0f} | {dumps:.0f} | {reused:.0f} | {dumps / ours:.1f}x |")


@pytest.mark.parametrize("kind", list(TOKENS))
@pytest.mark.benchmark(group="sse-chat-chunk")
def test_ours(benchmark, kind):
    stream = ChatStream(ID, CREATED, MODEL)
    benchmark(encode_fast, stream, TOKENS[kind])


@pytest.mark.parametrize("kind", list(TOKENS))
@pytest.mark.benchmark(group="sse-chat-chunk")
def test_json_dumps(benchmark, kind):
    benchmark(encode_json_dumps, TOKENS[kind])


if __name__ == "__main__":
    main()
