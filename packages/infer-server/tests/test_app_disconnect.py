"""A client that hangs up aborts its request, streaming or not: the engine stops generating for
it within a step, its KV blocks are freed, it is counted as a disconnect, and others still finish;
with the engine core in the server's process and in a process of its own (`infer serve`'s
default)."""

import socket
import time

import httpx
import pytest


def wait_until(condition, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.02)


@pytest.fixture(scope="module", params=["in_process", "engine_process"])
def server(request, start_server):
    running = start_server(max_batch_size=4, engine_process=request.param == "engine_process")
    yield running
    running.stop()


def engine_idle(server) -> bool:
    # The core's own statistics, sent with its steps (from a child process too).
    stats = server.engine.stats()
    return stats.num_running == stats.num_waiting == stats.kv_bytes_used == 0


def long_request(server, stream: bool) -> dict:
    # ignore_eos: it would run 400 tokens (minutes on a CPU) unless the abort stops it.
    return {
        "model": server.model,
        "prompt": "Count:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": stream,
    }


def counters(server) -> tuple[float, float]:
    metrics = server.state.metrics
    return metrics.client_disconnects_total.value(), metrics.requests_total.value(finish_reason="abort")


def test_stream_client_hanging_up_frees_the_blocks(server):
    wait_until(lambda: engine_idle(server), what="an idle engine before the test")
    disconnects, aborts = counters(server)
    with (
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
        client.stream("POST", "/v1/completions", json=long_request(server, stream=True)) as response,
    ):
        events = (line for line in response.iter_lines() if line.startswith("data:"))
        next(events), next(events)  # generating
        assert server.engine.stats().num_running == 1
        # Another client is served meanwhile.
        other = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": server.model, "prompt": "Hi", "max_tokens": 2},
            timeout=60.0,  # a loaded 2-core machine shares its cores with the stream's steps
        )
        assert other.status_code == 200
    wait_until(lambda: engine_idle(server), what="the blocks freed after the disconnect")
    # The blocks are freed on the engine thread; the abort's final output reaches the metrics a
    # moment later, on the event loop.
    expected = (disconnects + 1, aborts + 1)
    wait_until(lambda: counters(server) == expected, timeout_s=5.0, what=f"counters {expected}")
    steps_at_idle = server.engine.stats().num_steps
    time.sleep(0.3)
    assert server.engine.stats().num_steps == steps_at_idle, "the engine keeps stepping after the abort"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_client_hanging_up_frees_the_blocks(server, endpoint):
    wait_until(lambda: engine_idle(server), what="an idle engine before the test")
    disconnects, aborts = counters(server)
    body = long_request(server, stream=False)
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    # A raw socket, so the test decides exactly when the client goes away.
    payload = httpx.Request("POST", server.base_url + endpoint, json=body)
    raw = (
        f"POST {endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload.read())}\r\n\r\n"
    ).encode() + payload.read()
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(raw)
        wait_until(lambda: server.engine.stats().num_running == 1, what="the request running")
    wait_until(lambda: engine_idle(server), what="the blocks freed after the disconnect")
    # The blocks are freed on the engine thread; the abort's final output reaches the metrics a
    # moment later, on the event loop.
    expected = (disconnects + 1, aborts + 1)
    wait_until(lambda: counters(server) == expected, timeout_s=5.0, what=f"counters {expected}")
    answer = server.openai_client().completions.create(model=server.model, prompt="Hi", max_tokens=2)
    assert answer.usage.completion_tokens == 2
