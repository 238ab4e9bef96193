"""Our own server for the api contract when no --base-url is given: the default model on
127.0.0.1, started once per session on first use (in a thread of the test process), stopped at exit.

Checks that need a server set up differently (a tiny waiting queue, a model load held back) start
their own with `extra_server(server_args)` and stop it when they are done. The auth and CORS checks
share one more, started once like ours: `guarded_server_url()`, with GUARDED_API_KEY and
ALLOWED_ORIGIN.
"""

import atexit
import contextlib
import functools
import threading
import time
from collections.abc import Iterator

DEFAULT_MODEL = "smollm2-135m-instruct"
# A 2048-token context and 4 slots keep the KV pool small on a CPU; every case fits in it.
ENGINE_SETTINGS = {"max_seq_len": 2048, "max_batch_size": 4}
# Generous for a CPU: loading SmolLM2-135M takes seconds, the first start may convert it.
START_TIMEOUT_S = 600.0
# The guarded server's key and the one browser origin it allows (specs/api/auth.yaml).
GUARDED_API_KEY = "conformance-key-7f3a9c"
ALLOWED_ORIGIN = "http://allowed.example"


@functools.cache
def own_server_url() -> str:
    """The base URL of our server (no /v1), started on the first call."""
    from infer.server.serve import BackgroundServer

    server = BackgroundServer(_engine_factory({}), served_model_name=DEFAULT_MODEL, log_level="warning")
    atexit.register(server.stop)
    return server.base_url


@functools.cache
def guarded_server_url() -> str:
    """The base URL of a server like ours that needs GUARDED_API_KEY and allows ALLOWED_ORIGIN,
    started on the first call."""
    from infer.server.access import AccessPolicy
    from infer.server.serve import BackgroundServer

    access = AccessPolicy(api_key=GUARDED_API_KEY, allowed_origins=(ALLOWED_ORIGIN,))
    server = BackgroundServer(
        _engine_factory({}), served_model_name=DEFAULT_MODEL, log_level="warning", access=access
    )
    atexit.register(server.stop)
    return server.base_url


@contextlib.contextmanager
def extra_server(
    server_args: dict, *, hold_loading: threading.Event | None = None, access=None
) -> Iterator[str]:
    """A server of its own on the default model, with ENGINE_SETTINGS updated by `server_args`
    (fields of infer.engine.EngineConfig) and `access` (an infer.server.access.AccessPolicy: its
    API key and CORS origins); yields its base URL (no /v1) and stops it on exit.

    Without `hold_loading` it is yielded once healthy. With it, it is yielded as soon as it
    listens, and the model load waits for the event (set on exit at the latest)."""
    from infer.server.serve import build_server

    factory = _engine_factory(server_args)

    def held_factory():
        hold_loading.wait(START_TIMEOUT_S)
        return factory()

    server = build_server(
        held_factory if hold_loading is not None else factory,
        port=0,
        served_model_name=DEFAULT_MODEL,
        log_level="warning",
        access=access,
    )
    thread = threading.Thread(target=server.run, name="infer-extra-server", daemon=True)
    thread.start()
    try:
        base_url = _wait_listening(server, thread)
        if hold_loading is None:
            wait_healthy(base_url)
        yield base_url
    finally:
        if hold_loading is not None:
            hold_loading.set()  # a load still held would keep the shutdown waiting
        server.should_exit = True
        thread.join(60.0)


def wait_healthy(base_url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Returns once GET /health answers 200; RuntimeError if the server failed, TimeoutError after
    `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base_url}/health", timeout=5.0)
        except httpx.TransportError:
            response = None
        if response is not None and response.status_code == 200:
            return
        if response is not None and response.json().get("status") == "failed":
            raise RuntimeError(f"the server on {base_url} failed: {response.json().get('error')}")
        time.sleep(0.05)
    raise TimeoutError(f"the server on {base_url} did not become healthy in {timeout_s} s")


def _engine_factory(server_args: dict):
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    config = EngineConfig(model=DEFAULT_MODEL, **{**ENGINE_SETTINGS, **server_args})
    return lambda: Engine(config)


def _wait_listening(server, thread: threading.Thread) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the extra server stopped during startup; see its log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the extra server did not listen within {START_TIMEOUT_S} s")
        time.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{host}:{port}"
