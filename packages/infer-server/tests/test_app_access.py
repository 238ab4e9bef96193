"""The API key and CORS on a real server on 127.0.0.1 (infer.server.access): the official openai
and anthropic clients with the right key get answers and with a wrong one raise
AuthenticationError; raw httpx for each protected route (the key as `Authorization: Bearer` or
`x-api-key`), the open ones, and CORS preflights as browsers send them."""

import os
import re
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from infer.models.tensor_parallel import free_local_port
from infer.server.access import AccessPolicy, parse_origins
from infer.server.serve import BackgroundServer

from .conftest import SERVED_MODEL

KEY = "sk-test-5d1e0a"
ORIGIN = "http://ui.example:3000"
CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{SERVED_MODEL}", None),
    ("POST", "/v1/completions", {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("GET", "/v1/stats", None),
]
# Each way a client gets the key wrong; none may pass. The constant-time compare is seen only by
# what it decides: a key that the right one starts with, one that starts with it, one a byte off.
WRONG = {
    "no header": None,
    "another scheme": f"Basic {KEY}",
    "empty key": "Bearer",
    "key's prefix": f"Bearer {KEY[:-1]}",
    "longer key": f"Bearer {KEY}0",
    "last byte off": f"Bearer {KEY[:-1]}b",
    "other key": "Bearer sk-other",
}


def start(make_engine, **access) -> BackgroundServer:
    return BackgroundServer(
        make_engine(max_batch_size=2),
        served_model_name=SERVED_MODEL,
        log_level="warning",
        access=AccessPolicy(**access),
    )


@pytest.fixture(scope="module")
def guarded(make_engine):
    server = start(make_engine, api_key=KEY, allowed_origins=(ORIGIN,))
    yield server
    server.stop()


def send(server, method: str, path: str, body, **headers) -> httpx.Response:
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=60.0)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60.0)


def test_the_openai_client_with_the_key_gets_answers(guarded):
    with_key = client(guarded, KEY)
    assert [model.id for model in with_key.models.list()] == [SERVED_MODEL]
    answer = with_key.chat.completions.create(model=SERVED_MODEL, messages=CHAT["messages"], max_tokens=1)
    assert answer.usage.completion_tokens == 1
    stream = with_key.completions.create(model=SERVED_MODEL, prompt="Hi", max_tokens=2, stream=True)
    assert [chunk.choices[0].finish_reason for chunk in stream if chunk.choices][-1] == "length"


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.models.list(),
        lambda c: c.completions.create(model=SERVED_MODEL, prompt="Hi", max_tokens=1),
        lambda c: c.chat.completions.create(model=SERVED_MODEL, messages=CHAT["messages"], max_tokens=1),
    ],
    ids=["models", "completions", "chat"],
)
def test_the_openai_client_with_a_wrong_key_raises_authentication_error(guarded, call):
    with pytest.raises(openai.AuthenticationError) as raised:
        call(client(guarded, "sk-wrong"))
    assert raised.value.status_code == 401
    assert raised.value.code == "invalid_api_key"


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=lambda value: str(value)[:30])
def test_each_protected_route_refuses_every_wrong_key_and_admits_the_right_one(guarded, method, path, body):
    for what, authorization in WRONG.items():
        headers = {} if authorization is None else {"Authorization": authorization}
        response = send(guarded, method, path, body, **headers)
        assert response.status_code == 401, what
        assert response.headers["www-authenticate"] == "Bearer", what
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
        assert KEY[:6] not in response.text, what  # the key is never quoted back
    assert send(guarded, method, path, body, Authorization=f"Bearer {KEY}").status_code == 200
    # RFC 7235: the scheme's name is case-insensitive.
    assert send(guarded, method, path, body, Authorization=f"bearer {KEY}").status_code == 200


MESSAGE = {"model": SERVED_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
# Where the key travels as x-api-key: the Anthropic SDK's header, which llama.cpp and vLLM take.
X_API_KEY_ROUTES = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/messages", MESSAGE),
    ("POST", "/v1/messages", {**MESSAGE, "stream": True}),
    ("POST", "/v1/messages/count_tokens", {key: MESSAGE[key] for key in ("model", "messages")}),
    ("GET", "/v1/models", None),
]
WRONG_X_API_KEY = {
    "empty key": "",
    "key's prefix": KEY[:-1],
    "longer key": f"{KEY}0",
    "other key": "sk-other",
}


@pytest.mark.parametrize(("method", "path", "body"), X_API_KEY_ROUTES, ids=lambda value: str(value)[:30])
def test_the_key_in_x_api_key_is_taken_and_a_wrong_one_refused(guarded, method, path, body):
    assert send(guarded, method, path, body, **{"x-api-key": KEY}).status_code == 200
    for what, sent in WRONG_X_API_KEY.items():
        response = send(guarded, method, path, body, **{"x-api-key": sent})
        assert response.status_code == 401, what
        assert KEY[:6] not in response.text, what
        # Beside a right Bearer key, a wrong x-api-key does not matter: either header may hold it.
        assert (
            send(
                guarded, method, path, body, Authorization=f"Bearer {KEY}", **{"x-api-key": sent}
            ).status_code
            == 200
        )


def test_anthropics_routes_refuse_in_anthropics_error_shape(guarded):
    for path, body in (
        ("/v1/messages", MESSAGE),
        ("/v1/messages/count_tokens", {"model": SERVED_MODEL, "messages": []}),
    ):
        response = send(guarded, "POST", path, body, **{"x-api-key": "sk-other"})
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"


def anthropic_client(server, **credentials) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=60.0, **credentials)


def test_the_anthropic_client_with_the_key_gets_answers_and_with_another_raises(guarded):
    messages = MESSAGE["messages"]
    for credentials in ({"api_key": KEY}, {"api_key": None, "default_headers": {"x-api-key": KEY}}):
        answer = anthropic_client(guarded, **credentials).messages.create(
            model=SERVED_MODEL, max_tokens=1, messages=messages
        )
        assert answer.usage.output_tokens == 1
    for credentials in (
        {"api_key": "sk-other"},
        {"api_key": None, "default_headers": {"x-api-key": "sk-other"}},
    ):
        with pytest.raises(anthropic.AuthenticationError) as raised:
            anthropic_client(guarded, **credentials).messages.create(
                model=SERVED_MODEL, max_tokens=1, messages=messages
            )
        assert raised.value.body["error"]["type"] == "authentication_error"


def test_a_path_no_route_answers_is_guarded_too(guarded):
    """Paths, not routes, are guarded: a route added later is covered from its first commit."""
    for path in ("/v1/not-a-route", "/not-a-route"):
        assert send(guarded, "POST", path, {}).status_code == 401, path
        assert send(guarded, "POST", path, {}, Authorization=f"Bearer {KEY}").status_code == 404, path
    # vLLM's root routes, whose bodies here are empty: guarded, then refused by the route itself.
    for path in ("/tokenize", "/detokenize"):
        assert send(guarded, "POST", path, {}).status_code == 401, path
        assert send(guarded, "POST", path, {}, Authorization=f"Bearer {KEY}").status_code == 400, path


def test_health_metrics_and_the_dashboard_page_need_no_key(guarded):
    assert send(guarded, "GET", "/health", None).json() == {"status": "ok"}
    metrics = send(guarded, "GET", "/metrics", None)
    assert metrics.status_code == 200 and "infer_requests_running" in metrics.text
    page = send(guarded, "GET", "/dashboard", None)
    assert page.status_code == 200 and "data-key-form" in page.text


def test_the_dashboard_asks_for_the_key_and_shows_the_numbers_with_it(guarded):
    """In headless Chromium (as test_dashboard_browser): without the key the page shows its key
    form and no numbers; given the key in the address's fragment it reads /v1/stats with it."""
    from .test_dashboard_browser import browse

    without = browse(f"{guarded.base_url}/dashboard", "--dump-dom")
    assert re.search(r"<form [^>]*data-key-form=\"\"[^>]*>", without) and "data-rendered" not in without
    assert re.search(r"<form [^>]*data-key-form=\"\" hidden", without) is None
    given = browse(f"{guarded.base_url}/dashboard#key={KEY}", "--dump-dom")
    assert re.search(r"<body data-rendered=\"[0-9.]+\">", given)
    assert re.search(r"<form [^>]*data-key-form=\"\" hidden", given)


def test_refusals_are_counted_by_status(guarded):
    def refused() -> float:
        text = send(guarded, "GET", "/metrics", None).text
        lines = [
            line
            for line in text.splitlines()
            if line.startswith('infer_requests_by_status_total{status="401"}')
        ]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = refused()
    send(guarded, "GET", "/v1/models", None)
    assert refused() == before + 1


def test_protect_metrics_guards_metrics_but_not_health(make_engine):
    server = start(make_engine, api_key=KEY, protect_metrics=True)
    try:
        assert send(server, "GET", "/metrics", None).status_code == 401
        assert send(server, "GET", "/metrics", None, Authorization=f"Bearer {KEY}").status_code == 200
        assert send(server, "GET", "/health", None).status_code == 200
    finally:
        server.stop()


def preflight(server, origin: str, method: str = "POST", path: str = "/v1/chat/completions"):
    # As a browser sends it before a fetch() with a JSON body and a key: no Authorization header.
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os",
    }
    return httpx.options(server.base_url + path, headers=headers)


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


def test_a_preflight_from_an_allowed_origin_succeeds_without_the_key(guarded):
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        response = preflight(guarded, ORIGIN, method, path)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == ORIGIN
        assert method in response.headers["access-control-allow-methods"].split(", ")
        assert response.headers["access-control-allow-headers"] == "authorization,content-type,x-stainless-os"


def test_a_preflight_from_another_origin_gets_no_cors_headers(guarded):
    for origin in ("http://evil.example", "http://ui.example:3001", "http://ui.example"):
        response = preflight(guarded, origin)
        assert cors_headers(response) == {}, origin
        assert response.status_code == 405  # the route's own answer to OPTIONS


def test_answers_to_an_allowed_origin_carry_its_cors_header_401s_included(guarded):
    ok = send(guarded, "GET", "/v1/models", None, Origin=ORIGIN, Authorization=f"Bearer {KEY}")
    refused = send(guarded, "GET", "/v1/models", None, Origin=ORIGIN)
    other = send(
        guarded, "GET", "/v1/models", None, Origin="http://evil.example", Authorization=f"Bearer {KEY}"
    )
    assert (ok.status_code, ok.headers["access-control-allow-origin"]) == (200, ORIGIN)
    assert (refused.status_code, refused.headers["access-control-allow-origin"]) == (401, ORIGIN)
    assert (other.status_code, cors_headers(other)) == (200, {})


def test_without_allowed_origins_no_answer_has_cors_headers(server):
    """The shared server (conftest): no key, no --allowed-origins, the defaults."""
    assert cors_headers(preflight(server, ORIGIN)) == {}
    answer = send(server, "GET", "/v1/models", None, Origin=ORIGIN)
    assert (answer.status_code, cors_headers(answer)) == (200, {})


def test_any_origin_with_a_star(make_engine):
    server = start(make_engine, allowed_origins=("*",))
    try:
        response = preflight(server, "http://anywhere.example")
        assert (response.status_code, response.headers["access-control-allow-origin"]) == (200, "*")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"api_key": ""}, "not empty"),
        ({"api_key": "two words"}, "without spaces"),
        ({"api_key": "clé"}, "printable ASCII"),
        ({"protect_metrics": True}, "needs an API key"),
        ({"allowed_origins": ("http://ui.example/app",)}, "no path"),
        ({"allowed_origins": ("null",)}, "scheme://host"),
    ],
)
def test_a_policy_that_could_never_work_is_refused(options, says):
    with pytest.raises(ValueError, match=says):
        AccessPolicy(**options)


def test_the_key_is_not_in_the_policys_repr():
    assert KEY not in repr(AccessPolicy(api_key=KEY))


def test_origins_are_read_as_browsers_send_them():
    values = ["HTTP://UI.example:3000/,http://b.example", "http://b.example", " https://c.example "]
    assert parse_origins(values) == ("http://ui.example:3000", "http://b.example", "https://c.example")


# -- `infer serve`'s flags ------------------------------------------------------------------------


def infer_serve(*args: str, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "infer.server.cli", "serve", "--max-seq-len", "256", *args]
    return subprocess.Popen(command, env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)


def test_infer_serve_takes_its_key_from_infer_api_key_and_never_logs_it():
    port = free_local_port()
    base_url = f"http://127.0.0.1:{port}"
    process = infer_serve(
        "--port", str(port), "--allowed-origins", f"{ORIGIN}/", "--log-level", "info",
        env={"INFER_API_KEY": KEY, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120.0
        while not _healthy(base_url):
            assert process.poll() is None and time.monotonic() < deadline, "infer serve did not start"
            time.sleep(0.1)
        assert httpx.get(f"{base_url}/v1/models").status_code == 401
        assert (
            httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        )
        assert httpx.get(f"{base_url}/metrics").status_code == 200
        allowed = httpx.options(
            f"{base_url}/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
        )
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert "an API key is required on every path but /dashboard, /health, /metrics" in stderr, stderr
    assert KEY not in stderr


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--api-key", ""], {}, "the API key must be printable ASCII without spaces"),
        (["--protect-metrics"], {"INFER_API_KEY": ""}, "protecting /metrics needs an API key"),
        (["--allowed-origins", "ui.example"], {}, "allowed origin 'ui.example' is not scheme://host[:port]"),
    ],
    ids=["empty-key", "protect-metrics-without-key", "origin-without-scheme"],
)
def test_infer_serve_refuses_access_options_that_could_never_work(args, env, says):
    """An empty INFER_API_KEY means no key, as an unset one; an empty --api-key is a mistake
    (`--api-key "$KEY"` with KEY unset) that must not leave the server open."""
    process = infer_serve("--port", str(free_local_port()), *args, env=env)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert stderr.strip().splitlines()[-1].startswith(f"infer serve: {says}"), stderr


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False
