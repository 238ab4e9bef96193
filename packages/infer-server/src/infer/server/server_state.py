"""What every route needs: the server's phase, its engine loop, the served model and the metrics.

Phases: loading (the engine is being built in the background; /health and the generation
endpoints answer 503) -> ready -> draining (after SIGTERM: new generation requests get 503, the
ones in flight finish). `failed` when loading or an engine step raised: 503 until restarted.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from functools import cached_property

from infer.engine.engine_process import EngineStartError
from infer.models.registry import image_processor_for
from infer.models.vision import ImageProcessor
from infer.server import errors
from infer.server.engine_loop import EngineLoop
from infer.server.errors import ApiError
from infer.server.limits import RequestLimits
from infer.server.media import MediaPolicy
from infer.server.metrics import ServerMetrics
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
    ):
        """`engine_or_factory`: an infer.engine.Engine, or a no-argument callable that builds one
        (run on a worker thread at startup, so the server answers /health while it loads).
        `media_policy`: which image URLs the server fetches (default: none)."""
        self._engine_or_factory = engine_or_factory
        self._served_model_name = served_model_name
        self.limits = limits or RequestLimits()
        self.media_policy = media_policy or MediaPolicy()
        self.metrics = metrics
        self.stats = ServerStats()
        self.phase = LOADING
        self.failure: str | None = None
        self.created = int(time.time())
        self.engine = None
        self.engine_loop: EngineLoop | None = None
        self._load_task: asyncio.Future | None = None
        self._started_s: float | None = None  # when start() began building the engine

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the engine loop, or the background load that ends by starting it."""
        self._started_s = time.monotonic()
        if callable(self._engine_or_factory):
            logger.info("starting the engine (the model loads; /health answers 503 until it is ready) ...")
            factory: Callable = self._engine_or_factory
            self._load_task = asyncio.ensure_future(asyncio.to_thread(factory))
            self._load_task.add_done_callback(self._on_loaded)
        else:
            self._start_engine(self._engine_or_factory)

    def _on_loaded(self, task: asyncio.Future) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            error = task.exception()
            # A bad value or a missing file is the user's to fix and its message says how; an
            # engine process that failed says why itself; a traceback is for everything else.
            if not isinstance(error, ValueError | OSError | EngineStartError):
                logger.error("loading the engine failed", exc_info=error)
            self.phase, self.failure = FAILED, f"loading the model failed: {type(error).__name__}: {error}"
            return
        if self.phase == LOADING:
            self._start_engine(task.result())

    def _start_engine(self, engine) -> None:
        self.engine = engine
        self.engine_loop = EngineLoop(engine, self.metrics, asyncio.get_running_loop(), self.stats)
        self.engine_loop.start()
        self.phase = READY
        logger.info(
            "serving %s (context %d tokens), ready %.1f s after start",
            self.served_model_name,
            self.max_model_len,
            time.monotonic() - self._started_s,
        )

    async def stop(self) -> None:
        # Joined on the event loop, not a worker thread: at interpreter exit (atexit) the default
        # executor is already shut down. The engine thread ends within one step.
        if self.engine_loop is not None:
            self.engine_loop.stop()

    async def drain(self, timeout_s: float) -> None:
        """Stops taking requests (503) and waits up to `timeout_s` for those in flight to finish;
        what is left is then aborted (finish_reason "abort") so its clients get a terminal event."""
        if self.phase == READY:
            self.phase = DRAINING
        loop = self.engine_loop
        if loop is None:
            return
        logger.info("draining: %d requests in flight, waiting up to %.1f s", loop.num_live, timeout_s)
        deadline = time.monotonic() + timeout_s
        while loop.num_live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if loop.num_live:
            logger.warning("drain deadline passed: aborting %d requests", loop.abort_all())
            deadline = time.monotonic() + ABORT_GRACE_S
            while loop.num_live and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    # -- what the routes ask ------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        if self._served_model_name is not None:
            return self._served_model_name
        return self.engine.config.model if self.engine is not None else "(loading)"

    @property
    def max_model_len(self) -> int:
        return self.engine.max_seq_len

    @cached_property
    def max_prompt_chars(self) -> int:
        """The limit on a prompt's characters before tokenizing (see infer.server.limits)."""
        if self.limits.max_prompt_chars is not None:
            return self.limits.max_prompt_chars
        return self.max_model_len * self.engine.tokenizer.max_token_chars

    @cached_property
    def image_processor(self) -> ImageProcessor | None:
        """The model's image processor, read from its checkpoint folder (infer.models.vision);
        None for a model without a vision tower."""
        info = self.engine.model_info
        return image_processor_for(info.path, info.config.model_type)

    def health(self) -> tuple[int, dict]:
        """(status code, body) of GET /health."""
        if self.engine_loop is not None and self.engine_loop.failure is not None:
            self.phase, self.failure = FAILED, f"the engine failed: {self.engine_loop.failure}"
        if self.phase == READY:
            return 200, {"status": "ok"}
        body = {"status": self.phase}
        if self.failure:
            body["error"] = self.failure
        return 503, body

    def require_ready(self) -> EngineLoop:
        """The engine loop, or ApiError 503 while loading, draining or failed."""
        status, body = self.health()
        if status != 200:
            reasons = {
                LOADING: "the model is still loading; retry shortly",
                DRAINING: "the server is shutting down and takes no new requests",
                FAILED: body.get("error", "the server failed"),
            }
            raise ApiError(503, reasons[self.phase], errors.SERVER_ERROR, None, f"server_{self.phase}")
        return self.engine_loop

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise errors.model_not_found(model, [self.served_model_name])
