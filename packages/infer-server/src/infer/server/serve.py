"""Running the app on uvicorn, with a SIGTERM that drains instead of cutting requests off.

If the model fails to load, or an engine step fails, `infer serve` logs why and exits 1 (a
supervisor restarts it) instead of answering 503 forever; requests in flight get their error
event first. Servers built for tests (`BackgroundServer`) stay up in the failed phase instead.

SIGTERM (what Kubernetes and systemd send): the server keeps its socket open and answers new
generation requests with 503 (a load balancer moves on), lets the requests in flight finish for
up to `drain_timeout_s`, aborts what is left (its clients still get a terminal event), then shuts
uvicorn down and returns, so the process exits 0. SIGINT (Ctrl-C) is the same drain without the
wait: what is in flight is aborted at once (each client gets its error event and [DONE]) and
`infer serve` exits 130; a second Ctrl-C forces the exit.
"""

import asyncio
import logging
import signal
import socket

import uvicorn

from infer.server.access import AccessPolicy
from infer.server.app import create_app
from infer.server.limits import RequestLimits
from infer.server.media import MediaPolicy
from infer.server.served_models import DEFAULT_WAIT_TIMEOUT_S
from infer.server.server_state import FAILED, READY, ServerState

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# uvicorn's names: "auto" is uvloop where it is installed (infer-server depends on it where it
# builds), else asyncio. uvloop served W3 at 64 on an H200 1.16x as fast as asyncio, same tree
# (docs/benchmarks/serving.md#the-frontends-cpu).
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
# After the drain, uvicorn's own wait for connections to close: only idle keep-alive ones remain.
_GRACEFUL_SHUTDOWN_S = 5


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM drains the app's ServerState first (see the module doc)."""

    def __init__(
        self,
        config: uvicorn.Config,
        infer_state: ServerState,
        drain_timeout_s: float,
        *,
        exit_on_failure: bool = False,
    ):
        super().__init__(config)
        self.infer_state = infer_state
        self.drain_timeout_s = drain_timeout_s
        self.exit_on_failure = exit_on_failure
        # Set when the server stopped because the engine failed (to load, or in a step).
        self.failure: str | None = None
        # Set by Ctrl-C (SIGINT): the server stopped at the user's request, not cleanly drained.
        self.interrupted = False
        self._drain_requested = False
        self._drain_timeout_s: float | None = None  # of the latest drain requested
        self._drain_task: asyncio.Task | None = None
        self._said_where = False  # whether "listening on ..." was logged

    def request_drain(self, timeout_s: float | None = None) -> None:
        """Starts the drain at the next tick (safe from a signal handler or another thread).
        `timeout_s` (default drain_timeout_s): how long the requests in flight may still run; a
        later request only ever shortens it."""
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        if self._drain_timeout_s is None or timeout_s < self._drain_timeout_s:
            self._drain_timeout_s = timeout_s
            self._drain_requested = True

    def handle_exit(self, sig: int, frame) -> None:
        # Neither signal is passed to uvicorn: it would record the signal and re-raise it after
        # shutdown, and the process would die of it (SIGINT: a KeyboardInterrupt traceback).
        if sig == signal.SIGTERM and not self.should_exit:
            self.request_drain()
        elif sig == signal.SIGINT and not self.interrupted:
            # uvicorn's own graceful stop would wait up to _GRACEFUL_SHUTDOWN_S for open streams,
            # then cancel them mid-response: a cut connection for the client and a CancelledError
            # traceback in the log. Aborted first, each stream ends with its terminal event.
            self.interrupted = True
            self.request_drain(timeout_s=0.0)
        elif sig == signal.SIGINT:
            self.should_exit = self.force_exit = True  # a second Ctrl-C: stop without waiting
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s on the event loop: the place to start and watch the drain.
        if self._drain_requested:
            self._drain_requested = False
            logger.info("stopping: draining for up to %.1f s", self._drain_timeout_s)
            # A drain already running (SIGTERM, then Ctrl-C) finishes once this one has aborted.
            self._drain_task = asyncio.create_task(self.infer_state.drain(self._drain_timeout_s))
        if self._drain_task is not None and self._drain_task.done():
            self.should_exit = True
        if not self._said_where and self.infer_state.phase == READY:
            # Once requests are answered, not when the socket opens: until the model is loaded
            # every generation request gets 503.
            self._said_where = True
            for url in self.listening_urls():
                logger.info("listening on %s", url)
        if self.exit_on_failure and self.failure is None and self._engine_failed():
            self.failure = self.infer_state.failure
            logger.error("%s; the server stops", self.failure)
            self.should_exit = True
        return await super().on_tick(counter)

    def listening_urls(self) -> list[str]:
        """http://HOST:PORT of each socket the server listens on (the port as bound: --port 0
        takes a free one)."""
        urls = []
        for server in self.servers:
            for listening in server.sockets:
                host, port = listening.getsockname()[:2]
                urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        return urls

    def _engine_failed(self) -> bool:
        # health() is what turns an engine loop's failure into the failed phase.
        status, _ = self.infer_state.health()
        return status != 200 and self.infer_state.phase == FAILED


def build_server(
    engine_or_factory,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    event_loop: str = "auto",
    log_level: str = "info",
    limits: RequestLimits | None = None,
    media_policy: MediaPolicy | None = None,
    access: AccessPolicy | None = None,
    exit_on_failure: bool = False,
    max_loaded_models: int | None = None,
    idle_unload_s: float | None = None,
    model_wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
) -> DrainingServer:
    """The server, not started: `.run()` blocks until it exits, `.request_drain()` drains it.
    `engine_or_factory`: one model's, or {name: engine or factory} of several (create_app).
    `exit_on_failure`: stop (and set `.failure`) when the engine fails to load or in a step.
    `event_loop`: one of EVENT_LOOPS."""
    app = create_app(
        engine_or_factory,
        served_model_name=served_model_name,
        limits=limits,
        media_policy=media_policy,
        access=access,
        max_loaded_models=max_loaded_models,
        idle_unload_s=idle_unload_s,
        model_wait_timeout_s=model_wait_timeout_s,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        loop=event_loop,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        # The server's own keep-alive; clients such as openai reuse connections between requests.
        timeout_keep_alive=30,
    )
    return DrainingServer(config, app.state.server, drain_timeout_s, exit_on_failure=exit_on_failure)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), for `server.run(sockets=[...])`. Raises
    OSError when the address is taken or not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: accepted sockets inherit it, and asyncio turns Nagle's algorithm off
    # (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP. With proto 0, a stream's token
    # chunks after its headers waited for the client's delayed ACK: ~40 ms before the first token
    # on a kept-alive connection (uvicorn's own bind_socket has the same flaw: uvicorn#3149).
    listening = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError:
        listening.close()
        raise
    return listening


class BackgroundServer:
    """The server on a daemon thread, listening on a free port of `host` (tests, conformance,
    notebooks): started and healthy when the constructor returns; `stop()` ends it."""

    def __init__(
        self, engine_or_factory, *, host: str = "127.0.0.1", health_timeout_s: float = 600.0, **options
    ):
        """`options`: build_server's keyword arguments (served_model_name, drain_timeout_s, ...)."""
        import threading

        # Bound here and handed to uvicorn, so no other process can take the port meanwhile.
        self._socket = bind_socket(host, 0)
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        self.server = build_server(engine_or_factory, host=host, port=self.port, **options)
        self.state = self.server.infer_state
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="infer-server", daemon=True
        )
        self._thread.start()
        self._wait_healthy(health_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.base_url} stopped during startup; see its log")
            if self.state.phase == "failed":
                raise RuntimeError(f"the server on {self.base_url} failed: {self.state.failure}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the server on {self.base_url} did not become healthy in {timeout_s} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self.server.should_exit = True
            self._thread.join(timeout_s)
        self._socket.close()
