"""What every route needs: the server's phase, its models (infer.server.served_models), the
metrics and the statistics.

Phases: loading (the models of the start are being built in the background; /health and the
generation endpoints answer 503) -> ready -> draining (after SIGTERM: new generation requests get
503, the ones in flight finish). `failed` when a load or an engine step raised: 503 until
restarted.

A route asks `await server.model_for(request, body.model)` for the model its request names: that
checks the phase (503), the name (404), loads the model if it is not resident (waiting, bounded),
and holds it for the request. The returned ServedModel has what the route reads: `engine`,
`engine_loop`, `max_model_len`, `max_prompt_chars`, `image_processor`, `served_model_name`.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from starlette.requests import Request

from infer.server import errors
from infer.server.engine_loop import EngineLoop
from infer.server.errors import ApiError
from infer.server.limits import RequestLimits
from infer.server.media import MediaPolicy
from infer.server.metrics import ServerMetrics
from infer.server.served_models import DEFAULT_WAIT_TIMEOUT_S, ServedModel, ServedModels
from infer.server.stats import ServerStats

logger = logging.getLogger(__name__)

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
# Seconds a client is told to wait (Retry-After) before retrying a 503.
RETRY_AFTER_S = 1
# How long the end of a drain waits for the requests it aborted to hand back their slots.
ABORT_GRACE_S = 5.0


class ServerState:
    def __init__(
        self,
        engine_or_factory,
        *,
        served_model_name: str | None,
        metrics: ServerMetrics,
        limits: RequestLimits | None = None,
        media_policy: MediaPolicy | None = None,
        max_loaded_models: int | None = None,
        idle_unload_s: float | None = None,
        model_wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ):
        """`engine_or_factory`: an infer.engine.Engine, or a no-argument callable that builds one
        (run on a worker thread at startup, so the server answers /health while it loads); or a
        mapping of several, {served name: engine or factory}, the first the default.
        `served_model_name`: the one model's name (not with a mapping, whose keys are the names).
        `media_policy`: which image URLs the server fetches (default: none).
        `max_loaded_models`, `idle_unload_s`, `model_wait_timeout_s`: see
        infer.server.served_models (default: every model loaded at the start, for good)."""
        self.limits = limits or RequestLimits()
        self.media_policy = media_policy or MediaPolicy()
        self.metrics = metrics
        self.stats = ServerStats()
        self.phase = LOADING
        self.failure: str | None = None
        self.created = int(time.time())
        self.models = ServedModels(
            self._served_models(engine_or_factory, served_model_name),
            max_loaded=max_loaded_models,
            idle_unload_s=idle_unload_s,
            wait_timeout_s=model_wait_timeout_s,
        )
        self._load_task: asyncio.Future | None = None
        self._idle_task: asyncio.Future | None = None
        self._started_s: float | None = None  # when start() began building the engines

    def _served_models(self, engine_or_factory, served_model_name: str | None) -> list[ServedModel]:
        if not isinstance(engine_or_factory, Mapping):
            # One model: its metrics and statistics are the server's, as they always were.
            return [self._served_model(served_model_name, engine_or_factory, self.metrics, self.stats)]
        if served_model_name is not None:
            raise ValueError(
                "served_model_name names the one model; with several, the mapping's keys are their names"
            )
        if len(engine_or_factory) == 1:
            [(name, engine)] = engine_or_factory.items()
            return [self._served_model(name, engine, self.metrics, self.stats)]
        # Several: each its own, shown per model (infer.server.metrics.render_by_model, /v1/stats).
        # The HTTP statuses are counted once, for the server, by the app's middleware.
        status_counter = self.metrics.requests_by_status_total
        return [
            self._served_model(name, engine, ServerMetrics(requests_by_status=status_counter), ServerStats())
            for name, engine in engine_or_factory.items()
        ]

    def _served_model(self, name, engine_or_factory, metrics, stats) -> ServedModel:
        return ServedModel(
            name,
            engine_or_factory,
            limits=self.limits,
            media_policy=self.media_policy,
            metrics=metrics,
            stats=stats,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the engine loops, or the background loads that end by starting them."""
        self._started_s = time.monotonic()
        if all(model.can_unload for model in self.models.models[: self.models.max_loaded]):
            logger.info("starting the engine (the model loads; /health answers 503 until it is ready) ...")
            self._load_task = asyncio.ensure_future(self._load_initial())
        else:
            await self._load_initial()
        interval_s = self.models.idle_check_interval_s()
        if interval_s is not None:
            self._idle_task = asyncio.ensure_future(self._unload_idle_models(interval_s))

    async def _load_initial(self) -> None:
        await self.models.load_initial()
        failure = self.models.failure
        if failure is not None:
            self.phase, self.failure = FAILED, failure
        elif self.phase == LOADING:
            self.phase = READY
            logger.info("ready %.1f s after start", time.monotonic() - self._started_s)

    async def _unload_idle_models(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self.phase == READY:
                await self.models.unload_idle()

    async def stop(self) -> None:
        # Joined on the event loop, not a worker thread: at interpreter exit (atexit) the default
        # executor is already shut down. The engine thread ends within one step.
        for task in (self._idle_task, self._load_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.models.stop()

    async def drain(self, timeout_s: float) -> None:
        """Stops taking requests (503) and waits up to `timeout_s` for those in flight to finish;
        what is left is then aborted (finish_reason "abort") so its clients get a terminal event."""
        if self.phase == READY:
            self.phase = DRAINING
        self.models.accepting = False  # a request waiting for its model to load gets 503 too
        loops = self.models.engine_loops()
        if not loops:
            return

        def num_live() -> int:
            return sum(loop.num_live for loop in loops)

        logger.info("draining: %d requests in flight, waiting up to %.1f s", num_live(), timeout_s)
        deadline = time.monotonic() + timeout_s
        while num_live() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if num_live():
            num_aborted = sum(loop.abort_all() for loop in loops)
            logger.warning("drain deadline passed: aborting %d requests", num_aborted)
            deadline = time.monotonic() + ABORT_GRACE_S
            while num_live() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    # -- what the routes ask ------------------------------------------------------------------

    async def model_for(self, request: Request, name: str | None) -> ServedModel:
        """The model a request names (None: the default, for routes where `model` is optional),
        loaded and held until the request's answer ends. ApiError 503 while the server loads,
        drains or failed, or when the model cannot be loaded within --model-wait-timeout-s; 404
        for a model not served."""
        self.require_ready()
        return await self.models.acquire(request.scope, name)

    def health(self) -> tuple[int, dict]:
        """(status code, body) of GET /health; with several models, `models` gives each one's
        state (loaded, loading, unloading, unloaded, failed)."""
        failure = self.models.failure
        if failure is not None and self.phase != FAILED:
            self.phase, self.failure = FAILED, failure
        body = {"status": "ok"} if self.phase == READY else {"status": self.phase}
        if self.failure and self.phase == FAILED:
            body["error"] = self.failure
        if len(self.models) > 1:
            body["models"] = self.models.states()
        return (200 if self.phase == READY else 503), body

    def require_ready(self) -> EngineLoop | None:
        """The (one) engine loop, or ApiError 503 while loading, draining or failed."""
        status, body = self.health()
        if status != 200:
            reasons = {
                LOADING: "the model is still loading; retry shortly",
                DRAINING: "the server is shutting down and takes no new requests",
                FAILED: body.get("error", "the server failed"),
            }
            raise ApiError(503, reasons[self.phase], errors.SERVER_ERROR, None, f"server_{self.phase}")
        return self.models.default.engine_loop

    # -- the one model, for code written before several (tests, routes not yet converted) -------

    @property
    def _one_model(self) -> ServedModel:
        if len(self.models) > 1:
            raise RuntimeError(
                "this server serves several models: ask `await server.model_for(request, body.model)` "
                "for the request's, not server.engine"
            )
        return self.models.default

    @property
    def engine(self):
        return self._one_model.engine

    @property
    def engine_loop(self) -> EngineLoop | None:
        return self._one_model.engine_loop

    @property
    def served_model_name(self) -> str:
        return self._one_model.served_model_name

    @property
    def max_model_len(self) -> int:
        return self._one_model.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return self._one_model.max_prompt_chars

    @property
    def image_processor(self):
        return self._one_model.image_processor

    def check_model(self, model: str) -> None:
        """ApiError 404 unless `model` is served here."""
        self.models.get(model)
