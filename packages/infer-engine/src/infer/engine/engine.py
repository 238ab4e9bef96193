"""Engine: text or token ids in, one StepOutput per new token out; the frontend of one core.

It is what the server and `infer generate` hold: the model's `ModelInfo` (tokenizer, chat
template) without touching the weights, an `EngineClient` to the core, and the
`OutputProcessor` that turns the core's token ids into text. `Engine(config)` runs the core in
this process (stepped by whichever thread calls `step()`); `Engine.spawn(config)` runs it in a
child process (`infer.engine.engine_process`), so that the core's loop shares no GIL with the
frontend's HTTP, tokenizing and detokenizing.

`Engine.spawn` with data_parallel_size > 1 runs that many cores, each in a process of its own,
behind a router (`infer.engine.data_parallel`); the frontend sees one core.

`add_request` and `abort` may be called from any thread; `step()` from one thread at a time.
`add_request` checks what the core would refuse (the prompt's ids, the context, a full queue)
and raises before sending anything; the core checks again.
"""

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from infer.engine.client import EngineClient, EngineDeadError, InProcClient
from infer.engine.config import EngineConfig
from infer.engine.engine_core import EngineCore
from infer.engine.images import PromptImage
from infer.engine.output_processor import OutputProcessor, StepOutput
from infer.engine.protocol import EngineRequest, EngineStats
from infer.engine.request import QueueFullError
from infer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infer.models import LoadedModel


class Engine:
    def __init__(self, config: EngineConfig, loaded_model=None):
        """The core in this process. `loaded_model`: an infer.models.LoadedModel; None loads
        config.model (its dtype and device then come from the config; a given model keeps its
        own)."""
        core = EngineCore(config, loaded_model)
        self._connect(InProcClient(core), core.loaded.info, core.stats())
        self.core: EngineCore | None = core

    @classmethod
    def spawn(cls, config: EngineConfig, **client_options) -> "Engine":
        """The core in a child process; returns once it is built (weights loaded, warmed up).
        Raises EngineStartError with the child's reason when it could not be built.
        `client_options`: ProcClient's (startup_timeout_s, unresponsive_timeout_s)."""
        from concurrent.futures import ThreadPoolExecutor

        from infer.engine.engine_process import ProcClient
        from infer.models.load import load_model_info, model_folder

        # A name that is no model fails here, before a child starts; an alias is fetched here once.
        folder = model_folder(config.model, config.load_format)
        # The frontend's tokenizer then loads while the child builds the core, not before it:
        # their seconds overlap. Should both fail, the loader's error is the one raised.
        with ThreadPoolExecutor(1, thread_name_prefix="infer-model-info") as loader:
            model_info = loader.submit(load_model_info, folder)
            try:
                if config.data_parallel_size > 1:
                    from infer.engine.data_parallel import DataParallelClient

                    client = DataParallelClient(config, **client_options)
                else:
                    client = ProcClient(config, **client_options)
            except BaseException:
                model_info.exception()  # waits for the loader
                model_info.result()
                raise
            if model_info.exception() is not None:
                client.shutdown()
            model_info = model_info.result()
        engine = cls.__new__(cls)
        engine._connect(client, model_info, client.initial_stats)
        engine.core = None
        return engine

    def _connect(self, client: EngineClient, model_info, stats: EngineStats) -> None:
        # The core's config: its auto settings decided for the device it runs on.
        self.config = client.limits.config
        self.settings_line = client.limits.settings_line
        self.client = client
        self.model_info = model_info
        self.tokenizer = model_info.tokenizer
        self.limits = client.limits
        self.max_seq_len = client.limits.max_seq_len
        self.eos_token_ids = client.limits.eos_token_ids
        self.processor = OutputProcessor(self.tokenizer)
        self._stats = stats
        self._num_sent = 0

    # -- what the frontend calls ----------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        images: Sequence[PromptImage] = (),
    ) -> str:
        """Queues a request; returns its id. A str prompt is encoded with the tokenizer's special
        tokens (BOS); a chat prompt rendered by our templates should come as ids. With prefix
        caching, requests reuse each other's cached tokens only under the same `cache_salt`.
        `images`: a vision-language model's images, over their placeholder tokens in the prompt
        (infer.engine.images). Raises
        RequestTooLongError (ValueError) when it can never fit, ValueError for bad ids,
        InvalidParamError for a setting the model cannot honour, and QueueFullError when
        max_queue_len requests already wait."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_ids = [int(token_id) for token_id in prompt]
        images = tuple(images)
        self.limits.check_request(prompt_ids, params, images)
        request_id = request_id if request_id is not None else f"req-{self._num_sent}"
        if request_id in self.processor:
            raise ValueError(f"request id {request_id!r} is already queued or running; ids must be unique")
        num_waiting = self._num_waiting()
        if num_waiting >= self.limits.max_queue_len:
            raise QueueFullError(
                f"{num_waiting} requests are waiting, the limit max_queue_len is "
                f"{self.limits.max_queue_len}; retry later"
            )
        self.processor.add(request_id, prompt_ids, params)
        try:
            self.client.add(
                EngineRequest(
                    request_id,
                    prompt_ids,
                    params,
                    arrival_s=time.monotonic(),
                    cache_salt=cache_salt,
                    images=images,
                )
            )
        except BaseException:  # the core is gone (EngineDeadError): nothing was queued
            self.processor.forget(request_id)
            raise
        self._num_sent += 1
        return request_id

    def abort(self, request_id: str) -> bool:
        """Asks for `request_id` to stop; a later step frees its blocks and yields its final
        StepOutput (finish_reason "abort"). False when the id is unknown or already finished."""
        if request_id not in self.processor:
            return False
        # A core that is gone has stopped every request already; its failure is reported by
        # step(), not by every abort that follows it.
        with contextlib.suppress(EngineDeadError):
            self.client.abort([request_id])
        return True

    def has_work(self) -> bool:
        return self.processor.num_live > 0 or self.client.has_work()

    def step(self, wait_s: float = 0.0) -> list[StepOutput]:
        """The StepOutputs of the core's next step (one per new token, plus final outputs of
        aborted and failed requests, in a deterministic order), waiting up to `wait_s` for one.
        In this process the core runs that step now. Raises EngineDeadError when the core is
        gone."""
        engine_outputs = self.client.get_outputs(wait_s)
        if engine_outputs is None:
            return []
        if engine_outputs.stats is not None:
            self._stats = engine_outputs.stats
        step_outputs, stopped_by_text = self.processor.process(engine_outputs)
        if stopped_by_text:
            self.client.abort(stopped_by_text)
        return step_outputs

    def stats(self) -> EngineStats:
        """The core's statistics after the latest step this frontend received; waiting requests
        include those sent since. With data parallelism, the replicas' sums."""
        return dataclasses.replace(self._stats, num_waiting=self._num_waiting())

    def replica_stats(self) -> list[EngineStats] | None:
        """With data parallelism, each replica's statistics as it last sent them (replicas that
        failed keep their last); None with one core."""
        stats = getattr(self.client, "replica_stats", None)
        return None if stats is None else list(stats)

    def num_routed_by_prefix(self) -> int:
        """With data parallelism, requests the router sent where their prefix went; else 0."""
        router = getattr(self.client, "router", None)
        return 0 if router is None else router.num_prefix_routed

    def replicas_alive(self) -> list[bool] | None:
        """With data parallelism, which replicas still serve; None with one core."""
        router = getattr(self.client, "router", None)
        return None if router is None else list(router.alive)

    def _num_waiting(self) -> int:
        # What the core last said was waiting, plus what was sent since it said so.
        return self._stats.num_waiting + self._num_sent - self._stats.num_added

    def shutdown(self) -> None:
        self.client.shutdown()


def load_engine(config: EngineConfig) -> tuple["LoadedModel", Engine]:
    """(LoadedModel, Engine): config.model loaded on config.device (within
    device_memory_limit_gib, which the weights count against) and the engine over it in this
    process, stepped by the caller's thread: the same core as `infer serve`."""
    engine = Engine(config)
    return engine.core.loaded, engine
