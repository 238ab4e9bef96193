"""The engine core in a process of its own (`infer serve`'s default), and what happens when that
process dies, hangs, or cannot load the model: requests in flight end within seconds (a stream
with an error event then [DONE], a body with a 503), /health turns 503, and `infer serve` exits 1
with one clear line; never a hang, never a 200 for an unfinished answer. All on real processes:
the child is killed or stopped with real signals."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from infer.models.tensor_parallel import free_local_port


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (from /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


def engine_children(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned to run code (not its resource tracker)."""
    return [
        child for child in child_pids(pid) if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def engine_pid(server) -> int:
    return server.engine.client.process.pid


def data_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def long_body(server, *, stream: bool) -> dict:
    # ignore_eos: it would run 400 tokens (a minute on a CPU) unless something stops it.
    return {
        "model": server.model,
        "prompt": "Count:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": stream,
    }


def wait_until(condition, *, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def stream_and_body_when_the_engine_goes(server, signal_engine) -> tuple[list[str], dict, float]:
    """Starts a stream and a body, both generating, calls `signal_engine()`, and returns the
    stream's remaining events, the body's answer and the seconds both took to end after it."""
    body_answer: dict = {}

    def post_a_body() -> None:
        response = httpx.post(
            server.base_url + "/v1/completions", json=long_body(server, stream=False), timeout=120
        )
        body_answer.update(status=response.status_code, json=response.json(), headers=response.headers)

    with (
        httpx.Client(base_url=server.base_url, timeout=120.0) as client,
        client.stream("POST", "/v1/completions", json=long_body(server, stream=True)) as response,
    ):
        events = data_events(response)
        next(events)
        body_thread = threading.Thread(target=post_a_body)
        body_thread.start()
        wait_until(lambda: server.engine.stats().num_running == 2, what="both requests running")
        signalled_at = time.monotonic()
        signal_engine()
        rest = list(events)
        body_thread.join(timeout=60)
        took_s = time.monotonic() - signalled_at
    return rest, body_answer, took_s


def assert_ended_with_engine_errors(rest: list[str], body_answer: dict) -> None:
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])
    assert error["error"]["code"] == "engine_failed", error
    assert all(json.loads(event)["choices"][0]["finish_reason"] is None for event in rest[:-2])
    assert body_answer["status"] == 503, body_answer
    assert body_answer["json"]["error"]["code"] == "engine_failed"
    assert "retry-after" in body_answer["headers"]


def test_the_engine_runs_in_a_child_process_and_answers_as_in_process(start_server):
    # The same greedy answer from the core in a child process and in the server's own.
    answers = []
    for engine_process in (True, False):
        server = start_server(max_batch_size=2, engine_process=engine_process)
        if engine_process:
            assert engine_pid(server) in engine_children(os.getpid())
        answer = server.openai_client().completions.create(
            model=server.model, prompt="The capital of France is", max_tokens=12, temperature=0
        )
        answers.append(
            (answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens)
        )
        server.stop()
    assert answers[0] == answers[1]


def test_killing_the_engine_process_ends_streams_and_bodies_with_an_error_within_seconds(start_server):
    server = start_server(max_batch_size=2, engine_process=True)
    pid = engine_pid(server)
    rest, body_answer, took_s = stream_and_body_when_the_engine_goes(
        server, lambda: os.kill(pid, signal.SIGKILL)
    )
    assert_ended_with_engine_errors(rest, body_answer)
    assert took_s < 10
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 503 and "engine process exited" in health.json()["error"]
    refused = httpx.post(server.base_url + "/v1/completions", json={"model": server.model, "prompt": "Hi"})
    assert refused.status_code == 503
    server.stop()


def test_a_hung_engine_process_is_killed_and_its_requests_end_within_seconds(start_server):
    # Long enough that a step on a loaded CI machine is never taken for a hang.
    timeout_s = 10.0
    server = start_server(
        max_batch_size=2, engine_process=True, client_options={"unresponsive_timeout_s": timeout_s}
    )
    pid = engine_pid(server)
    rest, body_answer, took_s = stream_and_body_when_the_engine_goes(
        server, lambda: os.kill(pid, signal.SIGSTOP)
    )
    assert_ended_with_engine_errors(rest, body_answer)
    # Silence counts from the last message read, a moment before the signal.
    assert timeout_s - 1 < took_s < timeout_s + 5
    assert "did not answer" in httpx.get(server.base_url + "/health").json()["error"]
    server.engine.client.process.join(5)
    assert not server.engine.client.process.is_alive(), "the hung process was not killed"
    server.stop()


# -- `infer serve` itself -------------------------------------------------------------------------


def start_infer_serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_local_port()
    command = [sys.executable, "-m", "infer.server.cli", "serve", "--port", str(port), "--max-seq-len", "256"]
    command += ["--max-batch-size", "2", "--log-level", "warning", *args]
    process = subprocess.Popen(
        command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE, text=True
    )
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, base_url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"infer serve was not healthy in {timeout_s} s")


def test_infer_serve_exits_1_with_one_line_when_its_engine_process_dies():
    process, base_url = start_infer_serve()
    try:
        wait_healthy(process, base_url)
        (engine,) = engine_children(process.pid)
        os.kill(engine, signal.SIGKILL)
        assert process.wait(timeout=30) == 1
        stderr = process.stderr.read()
        assert "Traceback" not in stderr, stderr
        assert [line for line in stderr.splitlines() if "engine process exited" in line] != [], stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def checkpoint_with_broken_weights(tmp_path):
    """A tiny checkpoint whose tokenizer and config read fine but whose weights file is cut short:
    the frontend's ModelInfo loads, the engine process's model does not."""
    from infer.models.random_checkpoint import make_random_checkpoint

    folder = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny")
    (weights,) = folder.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    return folder


def test_infer_serve_exits_1_with_one_line_when_the_engine_process_cannot_load_the_model(
    checkpoint_with_broken_weights,
):
    process, _ = start_infer_serve("--model", str(checkpoint_with_broken_weights))
    try:
        assert process.wait(timeout=120) == 1
        stderr = process.stderr.read()
        assert "Traceback" not in stderr, stderr
        failures = [line for line in stderr.splitlines() if "loading the model failed" in line]
        assert len(failures) == 1, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
