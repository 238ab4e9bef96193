"""The models one server serves: `ServedModels` owns them (name -> engine loop, state, last use)
and gives a route the model its request names (`ServerState.model_for` asks it).

Each `ServedModel` builds its engine from a factory (a no-argument callable; an Engine given
ready-made is loaded for good), runs it under an EngineLoop, and keeps its own metrics and
statistics across loads. Its state:

    unloaded -> loading -> loaded -> unloading -> unloaded      (failed: its load raised)

A request for a model that is not resident loads it; when `max_loaded` models are resident, the
least recently used one with nothing in flight is unloaded first: its engine is shut down (an
engine process ends, an engine in this process is dropped), and its prefix cache goes with it.
When every resident model is busy the request waits for one to become idle; a request for a
model that is loading or unloading waits for it. Every wait is bounded by `wait_timeout_s`,
after which the request gets 503 + Retry-After. With `idle_unload_s`, a model idle that long is
unloaded by `unload_idle` (the server calls it every `idle_check_interval_s()`), as Ollama's
keep_alive, and loads again on its next request.

"In flight" counts leases: `acquire` takes one for the HTTP exchange, and `ReturnModelLeases`
(middleware) gives it back when the exchange ends, a streamed answer's last event included. So a
model is never unloaded between a request's tokenizing and its last token.
"""

import asyncio
import contextlib
import gc
import logging
import time
from functools import cached_property

import torch
from starlette.types import ASGIApp, Receive, Scope, Send

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

UNLOADED, LOADING, LOADED, UNLOADING, FAILED = "unloaded", "loading", "loaded", "unloading", "failed"
# How long a request waits for its model (to load, or for a slot to free) before a 503.
DEFAULT_WAIT_TIMEOUT_S = 300.0
# Where a request's leases are kept in its ASGI scope until ReturnModelLeases gives them back.
_LEASES_KEY = "infer.model_leases"
# A waiting request looks again at least this often (an in-flight count can drop without a
# notification: an aborted request's last step).
_RECHECK_S = 0.1


class ServedModel:
    """One model of the server: what routes ask of it (engine, engine_loop, max_model_len,
    max_prompt_chars, image_processor, served_model_name, media_policy) and its load state."""

    def __init__(
        self,
        name: str | None,
        engine_or_factory,
        *,
        limits: RequestLimits,
        media_policy: MediaPolicy,
        metrics: ServerMetrics,
        stats: ServerStats,
    ):
        """`name`: the `model` requests must name (None: the engine's config.model, known once
        loaded)."""
        self._name = name
        self._engine_or_factory = engine_or_factory
        self.limits = limits
        self.media_policy = media_policy
        self.metrics = metrics
        self.stats = stats
        self.state = UNLOADED
        self.failure: str | None = None
        self.engine = None
        self.engine_loop: EngineLoop | None = None
        self.num_leases = 0
        self.last_used_s = time.monotonic()
        self.num_loads = 0
        self._max_model_len: int | None = None  # kept after an unload, for /v1/models
        self._pooling_type: str | None = None  # likewise
        self.num_waiting = 0  # requests waiting in ServedModels.acquire for this model
        self.closed = False  # the server stops: a load that ends now shuts its engine down
        self._settled: asyncio.Event | None = None  # set when a load or an unload ends

    @property
    def can_unload(self) -> bool:
        """Only a model built by a factory can be loaded again."""
        return callable(self._engine_or_factory)

    @property
    def served_model_name(self) -> str:
        if self._name is not None:
            return self._name
        if self.engine is not None:
            return self.engine.config.model
        if not callable(self._engine_or_factory):
            return self._engine_or_factory.config.model
        return "(loading)"

    @property
    def max_model_len(self) -> int | None:
        """The context length; None for a model never loaded yet."""
        return self.engine.max_seq_len if self.engine is not None else self._max_model_len

    @property
    def pooling_type(self) -> str | None:
        """How /v1/embeddings pools this model's hidden states (EngineConfig.pooling_type); None
        for a model never loaded yet."""
        return self.engine.config.pooling_type if self.engine is not None else self._pooling_type

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

    @property
    def is_idle(self) -> bool:
        """Loaded, with no request in flight and none waiting for it: may be unloaded."""
        return self.state == LOADED and self.num_in_flight == 0 and self.num_waiting == 0

    @property
    def num_in_flight(self) -> int:
        """Requests holding the model: leases, and engine requests still running (an aborted
        one's last step comes after its HTTP exchange ended)."""
        live = self.engine_loop.num_live if self.engine_loop is not None else 0
        return self.num_leases + live

    # -- loading and unloading (on the event loop) ------------------------------------------

    def begin_load(self) -> asyncio.Future:
        """Starts building the engine (on a worker thread), its loop started once built; the
        state is `loading` from this call on, `failed` (with `failure`) if the build raises."""
        self.state, self.failure = LOADING, None
        self._settled = asyncio.Event()
        return asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        started_s = time.monotonic()
        try:
            logger.info("loading %s ...", self.served_model_name)
            engine = await asyncio.to_thread(self._engine_or_factory)
            if self.closed:  # the server stopped while it loaded: nobody will stop this engine
                engine.shutdown()
                self.state = UNLOADED
                self._settled.set()
                return
            self._start(engine)
        except Exception as error:  # noqa: BLE001 - the model's state says why; the server decides
            # A bad value or a missing file is the user's to fix and its message says how; an
            # engine process that failed says why itself; a traceback is for everything else.
            if not isinstance(error, ValueError | OSError | EngineStartError):
                logger.error("loading the engine failed", exc_info=error)
            self.state = FAILED
            self.failure = f"loading the model failed: {type(error).__name__}: {error}"
            self._settled.set()
            return
        logger.info(
            "serving %s (context %d tokens), ready %.1f s after its load began",
            self.served_model_name,
            self.max_model_len,
            time.monotonic() - started_s,
        )

    def start(self) -> None:
        """Starts a ready-made Engine at once (no load to wait for)."""
        self._settled = asyncio.Event()
        self._start(self._engine_or_factory)

    def _start(self, engine) -> None:
        if self.num_loads:  # a reload: the new engine counts its totals from 0 again
            self.metrics.engine_restarted()
            self.stats.engine_restarted()
        engine_loop = EngineLoop(engine, self.metrics, asyncio.get_running_loop(), self.stats)
        try:
            engine_loop.start()
        except BaseException:
            engine.shutdown()
            raise
        self.engine, self.engine_loop = engine, engine_loop
        if self._name is None:  # the name requests use stays when the model is unloaded
            self._name = engine.config.model
        self._max_model_len = engine.max_seq_len
        self._pooling_type = engine.config.pooling_type
        self.num_loads += 1
        self.last_used_s = time.monotonic()
        self.state = LOADED
        self._settled.set()

    def begin_unload(self) -> asyncio.Future:
        """Starts shutting the engine down; the state is `unloading` from this call on, and
        `unloaded` once the engine, its KV cache and its prefix cache are gone."""
        self.state = UNLOADING
        self._settled = asyncio.Event()
        return asyncio.ensure_future(self._unload())

    async def _unload(self) -> None:
        loop, self.engine_loop, self.engine = self.engine_loop, None, None
        for name in ("max_prompt_chars", "image_processor"):  # of that engine
            self.__dict__.pop(name, None)
        logger.info("unloading %s", self.served_model_name)
        # The engine thread ends within one step; an engine process is told to exit and joined.
        await asyncio.to_thread(loop.stop)
        del loop
        await asyncio.to_thread(_free_memory)
        self.metrics.engine_stopped()
        self.state = UNLOADED
        self._settled.set()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Returns when the load or unload under way ends, or after `timeout_s` (at once with
        neither under way: after `timeout_s`)."""
        if self._settled is None or self._settled.is_set():
            await asyncio.sleep(timeout_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout_s)


def _free_memory() -> None:
    """Returns a dropped in-process engine's memory: its tensors are freed once unreferenced,
    and CUDA's cache gives the blocks back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ServedModels:
    """The server's models in the order given (the first is the default of routes whose `model`
    is optional), and the policy that keeps at most `max_loaded` of them resident."""

    def __init__(
        self,
        models: list[ServedModel],
        *,
        max_loaded: int | None = None,
        idle_unload_s: float | None = None,
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ):
        if not models:
            raise ValueError("a server needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {max_loaded}")
        if idle_unload_s is not None and idle_unload_s <= 0:
            raise ValueError(f"idle_unload_s must be > 0, got {idle_unload_s}")
        if wait_timeout_s <= 0:
            raise ValueError(f"model_wait_timeout_s must be > 0, got {wait_timeout_s}")
        unloads = (max_loaded is not None and max_loaded < len(models)) or idle_unload_s is not None
        fixed = [model.served_model_name for model in models if not model.can_unload]
        if unloads and fixed:
            raise ValueError(
                f"models {fixed} were given as built engines, which cannot be loaded again once "
                "unloaded; give a factory (a callable that builds the engine) for each, or unload none"
            )
        self.models = models
        self.max_loaded = min(max_loaded or len(models), len(models))
        self.idle_unload_s = idle_unload_s
        self.wait_timeout_s = wait_timeout_s
        self._tasks: set[asyncio.Future] = set()  # loads and unloads under way
        # False once the server drains or stops: a request still waiting for its model gets 503.
        self.accepting = True

    def __len__(self) -> int:
        return len(self.models)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        return [model.served_model_name for model in self.models]

    def get(self, name: str | None) -> ServedModel:
        """The model named `name` (None: the default), or ApiError 404 listing the served ones."""
        if name is None:
            return self.default
        for model in self.models:
            if model.served_model_name == name:
                return model
        raise errors.model_not_found(name, self.names)

    @property
    def failure(self) -> str | None:
        """Why the server cannot serve: a model's load or an engine loop failed."""
        for model in self.models:
            if model.state == FAILED:
                return model.failure
            if model.engine_loop is not None and model.engine_loop.failure is not None:
                return f"the engine failed: {model.engine_loop.failure}"
        return None

    def _num_resident(self) -> int:
        return sum(model.state in (LOADING, LOADED, UNLOADING) for model in self.models)

    # -- startup and shutdown ---------------------------------------------------------------

    async def load_initial(self) -> None:
        """Loads the first `max_loaded` models, one after the other (two loads at once would
        only compete for the same memory and cores); stops at the first failure."""
        for model in self.models[: self.max_loaded]:
            if model.can_unload:
                await model.begin_load()
            else:
                model.start()
            if model.state == FAILED:
                return

    def stop(self) -> None:
        """Stops every engine, and any load still under way once it ends."""
        self.accepting = False
        for model in self.models:
            model.closed = True
            if model.engine_loop is not None:
                model.engine_loop.stop()

    def engine_loops(self) -> list[EngineLoop]:
        return [model.engine_loop for model in self.models if model.engine_loop is not None]

    # -- what a request needs ---------------------------------------------------------------

    async def acquire(self, scope: dict, name: str | None) -> ServedModel:
        """The model `name` names, loaded, with a lease for this HTTP exchange (`scope`, given
        back by ReturnModelLeases). Loads it if needed, unloading the least recently used idle
        model first when `max_loaded` are resident. ApiError 404 for a model not served; 503
        when it failed to load or the wait passed `wait_timeout_s`."""
        model = self.get(name)
        if model.state == LOADED:  # the common case: no wait
            return self._lease(model, scope)
        deadline = time.monotonic() + self.wait_timeout_s
        # Counted while waiting, so a model just loaded for this request is not idle (and not
        # unloaded for another) before the request takes its lease.
        model.num_waiting += 1
        try:
            while model.state != LOADED:
                if not self.accepting:
                    raise ApiError(
                        503,
                        "the server is shutting down and takes no new requests",
                        errors.SERVER_ERROR,
                        None,
                        "server_draining",
                    )
                if model.state == FAILED:
                    raise ApiError(503, model.failure or "", errors.SERVER_ERROR, None, "server_failed")
                if model.state == UNLOADED:
                    self._make_room_for(model)
                    if model.state == LOADING:
                        continue
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise self._wait_passed(model)
                await model.wait_for_change(min(remaining_s, _RECHECK_S))
        finally:
            model.num_waiting -= 1
        return self._lease(model, scope)

    def _make_room_for(self, model: ServedModel) -> None:
        """Starts loading `model` when a slot is free; else starts unloading the least recently
        used idle model, unless one is unloading already (its slot is about to free)."""
        if self._num_resident() < self.max_loaded:
            self._track(model.begin_load())
        elif not any(other.state == UNLOADING for other in self.models):
            idle = [other for other in self.models if other.is_idle]
            if idle:
                self._track(min(idle, key=lambda other: other.last_used_s).begin_unload())

    def _track(self, task: asyncio.Future) -> None:
        # The event loop keeps only weak references to tasks.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lease(self, model: ServedModel, scope: dict) -> ServedModel:
        model.num_leases += 1
        model.last_used_s = time.monotonic()
        scope.setdefault(_LEASES_KEY, []).append(model)
        return model

    def release(self, model: ServedModel) -> None:
        model.num_leases -= 1
        model.last_used_s = time.monotonic()

    def _wait_passed(self, model: ServedModel) -> ApiError:
        if model.state == LOADING:
            why = f"model {model.served_model_name!r} is still loading"
        else:
            busy = [other.served_model_name for other in self.models if other.state == LOADED]
            why = (
                f"model {model.served_model_name!r} is not loaded and the loaded models {busy} "
                f"(--max-loaded-models {self.max_loaded}) all have requests in flight"
            )
        return ApiError(
            503,
            f"{why} after a wait of {self.wait_timeout_s:g} s (--model-wait-timeout-s); retry later",
            errors.SERVER_ERROR,
            None,
            "model_not_ready",
        )

    # -- idle unloading ---------------------------------------------------------------------

    def idle_check_interval_s(self) -> float | None:
        """How often `unload_idle` should run; None when nothing is unloaded for idleness."""
        if self.idle_unload_s is None:
            return None
        return min(1.0, self.idle_unload_s / 4)

    async def unload_idle(self) -> None:
        """Unloads every model idle (nothing in flight or waiting) for `idle_unload_s`."""
        now = time.monotonic()
        for model in self.models:
            if model.is_idle and now - model.last_used_s >= self.idle_unload_s:
                logger.info("%s idle for %.1f s", model.served_model_name, now - model.last_used_s)
                await model.begin_unload()

    def states(self) -> dict[str, str]:
        """Each model's state, by name (/health)."""
        return {model.served_model_name: model.state for model in self.models}


class ReturnModelLeases:
    """Gives back the model leases a request took (ServedModels.acquire) once its HTTP exchange
    ends, streamed answers included (pure ASGI: the stream passes through untouched)."""

    def __init__(self, app: ASGIApp, models: ServedModels):
        self.app, self.models = app, models

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            for model in scope.pop(_LEASES_KEY, ()):
                self.models.release(model)
