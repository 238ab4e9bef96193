"""Draining: after SIGTERM (or `request_drain()`) new generation requests get 503, requests in
flight finish, and what is still running at the deadline is cancelled: a stream gets an error
event (then [DONE]), a body a 503, never a 200 with partial text or finish_reason "abort".
The SIGTERM test runs the real `infer serve` command in a subprocess and wants exit status 0; the
Ctrl-C test sends SIGINT mid-stream and wants the stream's error event, a prompt exit with status
130 and no traceback in the server's stderr."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from infer.models.tensor_parallel import free_local_port


def data_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def wait_for_health(base_url: str, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"/health did not answer {status} in {timeout_s} s")


@pytest.mark.parametrize("engine_process", [False, True], ids=["in_process", "engine_process"])
def test_drain_deadline_cancels_what_is_left_with_an_error_never_an_answer(start_server, engine_process):
    server = start_server(max_batch_size=2, drain_timeout_s=0.5, engine_process=engine_process)
    body = {"model": server.model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    in_flight_body: dict = {}

    def post_a_body_in_flight() -> None:
        response = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        in_flight_body.update(status=response.status_code, json=response.json(), headers=response.headers)

    with (
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        events = data_events(response)
        next(events)
        body_thread = threading.Thread(target=post_a_body_in_flight)
        body_thread.start()
        wait_until(lambda: server.engine.stats().num_running == 2, what="both requests running")
        server.server.request_drain()
        wait_for_health(server.base_url, 503, timeout_s=5)
        refused = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
        rest = list(events)
        body_thread.join(timeout=30)
    assert rest[-1] == "[DONE]"
    cancelled = json.loads(rest[-2])
    assert cancelled["error"]["code"] == "server_draining", cancelled
    chunks = [json.loads(event) for event in rest[:-2]]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    assert in_flight_body["status"] == 503, in_flight_body
    assert in_flight_body["json"]["error"]["code"] == "server_draining"
    assert "retry-after" in in_flight_body["headers"]
    wait_until(lambda: server.engine.stats().kv_bytes_used == 0, what="every KV block freed")
    server.stop()


def test_the_openai_client_sees_a_drain_as_503s_and_a_cut_stream_as_an_error(start_server):
    """What code written against OpenAI catches: a body cut off by the drain deadline and a
    request made while the server drains raise APIStatusError 503 (with Retry-After, for its
    retry logic), a stream cut off raises APIError with the server's error code."""
    # The new request is made while the drain runs: once the requests in flight are cut off,
    # the drain is over and the server exits, so a request then finds no server (on a slow
    # machine this raced). 2 s leaves it room; 400 tokens still outlast it.
    server = start_server(max_batch_size=2, drain_timeout_s=2.0)
    client = server.openai_client()
    counting = dict(model=server.model, prompt="Count:", max_tokens=400, extra_body={"ignore_eos": True})
    in_flight: dict = {}

    def post_a_body_in_flight() -> None:
        try:
            in_flight["answer"] = client.completions.create(**counting)
        except openai.APIStatusError as error:
            in_flight["answer"] = error

    with client.completions.create(**counting, stream=True) as stream:
        chunks = iter(stream)
        next(chunks)
        body_thread = threading.Thread(target=post_a_body_in_flight)
        body_thread.start()
        wait_until(lambda: server.engine.stats().num_running == 2, what="both requests running")
        server.server.request_drain()
        wait_for_health(server.base_url, 503, timeout_s=5)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=server.model, prompt="Hi", max_tokens=1)
        with pytest.raises(openai.APIError) as cut:
            list(chunks)
        body_thread.join(timeout=30)
    assert (refused.value.status_code, refused.value.body["code"]) == (503, "server_draining")
    assert refused.value.response.headers["retry-after"] == "1"
    assert cut.value.body["code"] == "server_draining"
    cut_body = in_flight["answer"]
    assert isinstance(cut_body, openai.APIStatusError), cut_body
    assert (cut_body.status_code, cut_body.body["code"]) == (503, "server_draining")
    server.stop()


def wait_until(condition, *, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
def test_infer_serve_drains_on_sigterm_and_exits_zero():
    port = free_local_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "infer.server.cli", "serve", "--port", str(port), "--max-seq-len", "256"]
    command += ["--max-batch-size", "2", "--drain-timeout-s", "60", "--log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_health(base_url, 200, timeout_s=120)
        models = httpx.get(base_url + "/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("smollm2-135m-instruct", 256)]
        body = {"model": "smollm2-135m-instruct", "prompt": "Count:", "max_tokens": 12, "ignore_eos": True}
        # The request in flight long enough (~200 steps of a few ms each) that the drain still runs
        # when the refused request is sent: at 12 tokens it had once finished, and the server exited.
        in_flight = {**body, "max_tokens": 200, "stream": True}
        with (
            httpx.Client(base_url=base_url, timeout=60.0) as client,
            client.stream("POST", "/v1/completions", json=in_flight) as response,
        ):
            events = data_events(response)
            next(events)
            process.send_signal(signal.SIGTERM)
            wait_for_health(base_url, 503, timeout_s=5)
            refused = httpx.post(base_url + "/v1/completions", json=body)
            assert refused.status_code == 503
            rest = list(events)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length", (
            "the request in flight finished"
        )
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_ctrl_c_during_a_stream_ends_it_with_an_error_event_and_exits_at_once_without_tracebacks(tmp_path):
    port = free_local_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "infer.server.cli", "serve", "--port", str(port), "--max-seq-len", "256"]
    command += ["--max-batch-size", "2", "--log-level", "warning"]
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        # A group of its own, as a shell gives a foreground job: Ctrl-C signals the whole group,
        # the engine's child process too.
        process = subprocess.Popen(
            command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=stderr, start_new_session=True
        )
    try:
        wait_for_health(base_url, 200, timeout_s=120)
        # Long enough to be mid-stream when the signal lands (~200 steps of a few ms each).
        body = {"model": "smollm2-135m-instruct", "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
        with (
            httpx.Client(base_url=base_url, timeout=60.0) as client,
            client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
        ):
            events = data_events(response)
            next(events)
            interrupted_at = time.monotonic()
            os.killpg(process.pid, signal.SIGINT)
            rest = list(events)  # a cut connection raises httpx.RemoteProtocolError here
        exit_code = process.wait(timeout=30)
        exit_took_s = time.monotonic() - interrupted_at
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["error"]["code"] == "server_draining", rest[-2]
    # uvicorn's own graceful stop waits up to 5 s for open streams before it cancels them.
    assert exit_took_s < 5.0, f"exited {exit_took_s:.1f} s after Ctrl-C"
    logged = stderr_path.read_text()
    assert "Traceback" not in logged and "CancelledError" not in logged, logged
    assert exit_code == 130, "128 + SIGINT, as a shell reports a command stopped by Ctrl-C"
