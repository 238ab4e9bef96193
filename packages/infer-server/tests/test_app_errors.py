"""Every error a client can provoke before generation starts, on a real server: the status the
rules of `infer.server.errors` give it, OpenAI's error body, and the server still serving after.
The `openai` client must map each status to its own exception class."""

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from infer.models.tensor_parallel import free_local_port
from infer.server.limits import RequestLimits
from infer.server.serve import build_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=60.0, **kwargs)


def assert_refused_and_still_serving(server, path: str, body, status: int, code: str, param, still) -> None:
    """A `refusal` case sent as it is: the status, OpenAI's error object naming `code` and
    `param`; then `still`, a (path, body) that must answer 200: the server still serves."""
    if isinstance(body, dict):
        body = json.dumps({key: server.model if value == "$MODEL" else value for key, value in body.items()})
    response = post(server, path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]
    still_path, still_body = still
    assert post(server, still_path, json=still_body).status_code == 200, "the server still serves"


def refusal(path: str, body, status: int, code: str, param: str | None):
    """One case: `body` (a dict; "$MODEL" stands for the served model, or raw bytes) sent to
    `path` must be refused with `status`, and error.code and error.param as given."""
    return pytest.param(path, body, status, code, param, id=f"{path[1:]}-{status}-{code}-{param}")


LONG_TEXT = "hello " * 2000  # ~2000 tokens: beyond the test server's 512-token context
CASES = [
    refusal(COMPLETIONS, b"{not json", 400, "invalid_json", None),
    refusal(COMPLETIONS, b"[1, 2]", 400, "invalid_body", None),
    refusal(COMPLETIONS, {"model": "$MODEL"}, 400, "missing_required_parameter", "prompt"),
    refusal(CHAT, {"model": "$MODEL", "messages": []}, 400, "empty_input", "messages"),
    refusal(
        COMPLETIONS,
        {"model": "$MODEL", "prompt": "Hi", "max_token": 3},
        400,
        "unknown_parameter",
        "max_token",
    ),
    refusal(
        COMPLETIONS,
        {"model": "$MODEL", "prompt": "Hi", "temperature": 2.5},
        400,
        "invalid_value",
        "temperature",
    ),
    refusal(CHAT, {"model": "$MODEL", "messages": HI, "top_p": 0}, 400, "invalid_value", "top_p"),
    refusal(COMPLETIONS, {"model": "$MODEL", "prompt": "Hi", "n": 0}, 400, "invalid_value", "n"),
    refusal(
        CHAT,
        {
            "model": "$MODEL",
            "messages": HI,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        },
        400,
        "unsupported_value",
        "response_format",
    ),
    refusal(
        CHAT,
        {
            "model": "$MODEL",
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        },
        400,
        "invalid_value",
        "tools.0.function.parameters",
    ),
    refusal(
        CHAT,
        {"model": "$MODEL", "messages": HI, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        400,
        "invalid_value",
        "tool_choice",
    ),
    refusal(COMPLETIONS, {"model": "no-such-model", "prompt": "Hi"}, 404, "model_not_found", "model"),
    refusal(
        CHAT, {"model": "no-such-model", "messages": HI, "stream": True}, 404, "model_not_found", "model"
    ),
    refusal(
        COMPLETIONS,
        {"model": "$MODEL", "prompt": "Hi", "max_tokens": 100_000},
        400,
        "context_length_exceeded",
        "prompt",
    ),
    refusal(
        COMPLETIONS,
        {"model": "$MODEL", "prompt": LONG_TEXT, "max_tokens": 1},
        400,
        "context_length_exceeded",
        "prompt",
    ),
    refusal(
        CHAT,
        {"model": "$MODEL", "messages": [{"role": "user", "content": LONG_TEXT}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
    refusal(
        COMPLETIONS, {"model": "$MODEL", "prompt": [10**9], "max_tokens": 1}, 400, "invalid_value", "prompt"
    ),
    # Issue 14: a template variable of the wrong type was a 500.
    refusal(
        CHAT,
        {"model": "$MODEL", "messages": HI, "chat_template_kwargs": {"default_system_prompt": 5}},
        400,
        "invalid_value",
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), CASES)
def test_refused_before_generation_with_an_openai_error_body(server, path, body, status, code, param):
    if isinstance(body, dict):
        body = {key: server.model if value == "$MODEL" else value for key, value in body.items()}
        response = post(server, path, json=body)
    else:
        response = post(server, path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), (
        "an error is never an event stream"
    )
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert isinstance(error["message"], str) and error["type"]


def test_a_20_mb_prompt_is_refused_before_tokenizing_by_the_default_limit(server):
    """Issue 14: a 20 MB prompt was tokenized before any check (30-70 s, 5 GB kept). The default
    limit is the most characters that could ever fit the context."""
    limit = server.engine.max_seq_len * server.engine.tokenizer.max_token_chars
    prompt = "a" * (20 * 2**20)
    response = post(server, COMPLETIONS, json={"model": server.model, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("prompt_too_large", "prompt")
    assert str(limit) in error["message"] and "--max-prompt-chars" in error["message"]
    messages = [{"role": "user", "content": prompt}]
    response = post(server, CHAT, json={"model": server.model, "messages": messages, "max_tokens": 1})
    assert response.status_code == 413 and response.json()["error"]["param"] == "messages"


def test_a_body_over_the_byte_limit_is_413_with_or_without_content_length(small_limits_server):
    server = small_limits_server
    body = json.dumps({"model": server.model, "prompt": "x" * 3000, "max_tokens": 1}).encode()
    declared = post(server, COMPLETIONS, content=body, headers={"content-type": "application/json"})

    def chunks():
        yield body[:1000]
        yield body[1000:]

    streamed = post(server, COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "2000" in error["message"]
        assert "--max-request-bytes" in error["message"]
    ok = post(server, COMPLETIONS, json={"model": server.model, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200, "the server still serves"


def test_a_prompt_over_the_character_limit_is_413_naming_the_field(small_limits_server):
    server = small_limits_server
    text = "word " * 30  # 150 characters, under the byte limit
    completion = post(server, COMPLETIONS, json={"model": server.model, "prompt": text, "max_tokens": 1})
    chat = post(
        server,
        CHAT,
        json={"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": 1},
    )
    for response, param in ((completion, "prompt"), (chat, "messages")):
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("prompt_too_large", param)
        assert "(100, --max-prompt-chars)" in error["message"]


@pytest.mark.parametrize(
    ("error_code", "prompt"),
    [("prompt_too_large", "word " * 30), ("request_too_large", "x" * 3000)],
    ids=["prompt-chars", "body-bytes"],
)
def test_the_openai_client_raises_its_status_error_with_413_for_either_limit(
    small_limits_server, error_code, prompt
):
    server = small_limits_server
    with pytest.raises(openai.APIStatusError) as caught:
        server.openai_client().completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == error_code


# A limit whose prompt takes the tokenizer long enough to time (about half a second on a CPU).
TOKENIZED_LIMIT_CHARS = 1_000_000


@pytest.fixture(scope="module")
def long_prompt_limit_server(start_server):
    running = start_server(max_batch_size=1, limits=RequestLimits(max_prompt_chars=TOKENIZED_LIMIT_CHARS))
    yield running
    running.stop()


def timed_post(server, path: str, body: dict) -> tuple[float, httpx.Response]:
    """(seconds the server took to answer, its response); the body is encoded before the clock starts."""
    content = json.dumps({"model": server.model, **body}).encode()
    started = time.monotonic()
    response = post(server, path, content=content, headers={"content-type": "application/json"})
    return time.monotonic() - started, response


def prompt_body(path: str, num_chars: int) -> dict:
    text = "hello " * (num_chars // len("hello "))
    if path == COMPLETIONS:
        return {"prompt": text, "max_tokens": 1}
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 1}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_prompt_over_the_character_limit_is_refused_before_it_is_tokenized(long_prompt_limit_server, path):
    """Issue 14: the check comes before the tokenizer. The oracle is the server's own tokenizing
    time: a prompt just under the limit is tokenized (refused as beyond the 512-token context,
    which only its token count tells), and one four times the limit is refused with 413 faster
    than that. Checked after tokenizing, the long one would take about four times as long."""
    server = long_prompt_limit_server
    # Under the limit by more than the chat template adds around the message.
    tokenized_s, tokenized = timed_post(server, path, prompt_body(path, TOKENIZED_LIMIT_CHARS - 1000))
    assert tokenized.status_code == 400, tokenized.text
    assert tokenized.json()["error"]["code"] == "context_length_exceeded"
    refused_s, refused = timed_post(server, path, prompt_body(path, 4 * TOKENIZED_LIMIT_CHARS))
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["code"] == "prompt_too_large"
    assert refused_s < tokenized_s, (
        f"413 after {refused_s:.2f} s, tokenizing a quarter of it took {tokenized_s:.2f} s: "
        "the long prompt was tokenized before the check"
    )


def test_infer_serve_size_flags_set_the_limits_its_413s_name(tmp_path_factory):
    """--max-request-bytes and --max-prompt-chars reach the app of the real `infer serve`: a
    prompt at the character limit runs, one character more and a body over the byte limit get
    413 naming the values given on the command line."""
    from infer.models.random_checkpoint import make_random_checkpoint

    checkpoint = make_random_checkpoint("llama-tiny", tmp_path_factory.mktemp("llama-tiny"))
    port = free_local_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "infer.server.cli", "serve", "--model", str(checkpoint)]
    command += ["--served-model-name", "tiny", "--port", str(port), "--engine-in-process"]
    command += ["--max-request-bytes", "3000", "--max-prompt-chars", "50", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(base_url):
            assert process.poll() is None, f"infer serve exited with {process.returncode}"
            assert time.monotonic() < deadline, "infer serve did not become healthy in 120 s"
            time.sleep(0.1)

        def complete(prompt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            return httpx.post(base_url + COMPLETIONS, json=body, timeout=60)

        assert complete("x" * 50).status_code == 200
        over_chars = complete("x" * 51)
        assert over_chars.status_code == 413, over_chars.text
        assert "(50, --max-prompt-chars)" in over_chars.json()["error"]["message"]
        over_bytes = complete([1] * 2000)  # token ids: no character check, 4000+ bytes
        assert over_bytes.status_code == 413, over_bytes.text
        assert "(3000, --max-request-bytes)" in over_bytes.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def test_a_template_variable_named_like_a_python_parameter_is_just_a_variable(server):
    """Issue 14: {"self": 1} collided with render()'s own parameter and answered 500."""
    body = {"model": server.model, "messages": HI, "max_tokens": 1, "chat_template_kwargs": {"self": 1}}
    response = post(server, CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_openai_client_maps_the_statuses_to_its_exceptions(server):
    client = server.openai_client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="Hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="Hi", temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HI)
    # ...and the server still serves.
    assert (
        client.completions.create(model=server.model, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    )


def test_unknown_path_is_an_openai_404(server):
    response = httpx.get(server.base_url + "/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def one_row_server(start_server):
    """One running request at a time and a waiting queue of one: the third concurrent request must get 503."""
    running = start_server(max_batch_size=1, max_queue_len=1)
    yield running
    running.stop()


def test_full_queue_answers_503_with_retry_after_and_admitted_requests_complete(one_row_server):
    server = one_row_server
    long_request = {
        "model": server.model,
        "prompt": "Count:",
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.base_url, timeout=60.0) as running_client,
        running_client.stream("POST", "/v1/completions", json=long_request) as running,
    ):
        first_events = running.iter_lines()
        next(line for line in first_events if line.startswith("data:"))  # running: it holds the only row
        # The headers of a stream are sent once the request is queued, so this one now waits.
        with (
            httpx.Client(base_url=server.base_url, timeout=60.0) as waiting_client,
            waiting_client.stream("POST", "/v1/completions", json=long_request) as waiting,
        ):
            assert waiting.status_code == 200
            refused = post(server, "/v1/completions", json={**long_request, "stream": False})
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            waiting_lines = [line for line in waiting.iter_lines() if line.startswith("data:")]
        running_lines = [line for line in first_events if line.startswith("data:")]
    for lines in (running_lines, waiting_lines):
        assert lines[-1] == "data: [DONE]"
        assert sum('"finish_reason":"length"' in line for line in lines) == 1


def test_health_and_generation_answer_503_while_the_model_loads(make_engine):
    release = threading.Event()

    def slow_factory():
        release.wait(60)
        return make_engine(max_batch_size=1)

    model = "loading-test-model"
    server = build_server(slow_factory, port=0, served_model_name=model, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base_url = _wait_for_listening(server)
        health = httpx.get(base_url + "/health")
        assert (health.status_code, health.json()["status"]) == (503, "loading")
        refused = httpx.post(base_url + "/v1/completions", json={"model": model, "prompt": "Hi"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_loading"
        release.set()
        for _ in range(600):
            if httpx.get(base_url + "/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        answer = httpx.post(
            base_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1}
        )
        assert answer.status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def _wait_for_listening(server) -> str:
    for _ in range(600):
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            return f"http://127.0.0.1:{port}"
        threading.Event().wait(0.05)
    raise TimeoutError("uvicorn did not start listening")
