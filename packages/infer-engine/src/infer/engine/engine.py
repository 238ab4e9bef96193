"""Engine: requests in, one StepOutput per new token out, one scheduler iteration per `step()`.

Synchronous by design. The server calls `step()` in a loop from one dedicated thread while
`add_request` and `abort` may come from any thread: those two only validate and put the
request (or the abort) in an inbox under a lock, and the next `step()` takes the inbox in, so
the scheduler, the KV pool and the requests are touched by the stepping thread alone.

A step: take in new requests and aborts (an aborted request's blocks are free before anything
is scheduled, and it gets a final StepOutput with finish_reason "abort"), ask the scheduler for a
decision (`infer.engine.decision`), launch every scheduled token in one forward
(`ModelRunner.launch`), collect the sampled tokens (`ModelRunner.collect`), push each through
the request's StopChecker, then retire whatever finished. With `async_scheduling` a step
collects the previous step's tokens instead of its own, after launching its own: the device
runs step k while the host checks step k-1's tokens and schedules step k + 1. A request that
stops on a token is then already scheduled once more; that step's token for it is dropped.
A forward that raises fails only the requests of its step (FAILED, error set, blocks freed);
the engine goes on.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from infer.cache import KVCacheShape, PagedKVPool, kv_budget_from_free_memory, num_blocks_for_memory
from infer.engine.config import EngineConfig, EngineConfigError, resolve_device, resolve_dtype
from infer.engine.eos import eos_token_ids_of
from infer.engine.kv_manager import KVCacheManager
from infer.engine.request import (
    FINISH_ABORT,
    InvalidParamError,
    QueueFullError,
    Request,
    RequestState,
    StepOutput,
)
from infer.engine.runner import ModelRunner
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.stop import StopChecker

logger = logging.getLogger(__name__)

# The default max_seq_len when the config gives none: the model's context, at most this, so the
# default pool (room for max_batch_size sequences of max_seq_len) stays small for small models.
DEFAULT_MAX_SEQ_LEN_CAP = 4096


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    # Fraction of the pool's KV blocks in use; bytes count whole blocks.
    kv_usage_ratio: float
    kv_bytes_used: int
    kv_bytes_total: int
    num_steps: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_finished: int
    num_aborted: int
    num_failed: int
    # Preemptions so far (a request preempted twice counts twice).
    num_preempted: int
    # Wall time spent inside step() with work to do.
    busy_time_s: float
    # Prompt tokens over the busy time of the steps that ran prompt tokens (a step that also
    # decodes counts whole), so decoding stretches do not dilute it.
    prompt_tokens_per_s: float
    # Generated tokens over all busy time.
    generation_tokens_per_s: float


class Engine:
    def __init__(self, config: EngineConfig, loaded_model=None):
        """`loaded_model`: an infer.models.LoadedModel; None loads config.model (its dtype and
        device then come from the config; a given model keeps its own)."""
        self.config = config
        if loaded_model is None:
            from infer.models.load import load_model

            device = resolve_device(config.device)
            loaded_model = load_model(config.model, dtype=resolve_dtype(config.dtype, device), device=device)
        else:
            logger.info(
                "engine uses the given model from %s; config.model/dtype/device are not used",
                loaded_model.path,
            )
        self.loaded = loaded_model
        self.tokenizer = loaded_model.tokenizer
        model = loaded_model.model
        parameter = next(model.parameters())
        self.device = parameter.device
        self.max_seq_len = _resolve_max_seq_len(config, model.config.max_position_embeddings)
        self.kv_pool = _build_kv_pool(config, model, self.max_seq_len, self.device)
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f MiB)",
            self.kv_pool.num_blocks,
            self.kv_pool.block_size,
            self.kv_pool.kv_bytes / 2**20,
        )
        self.scheduler = Scheduler.from_engine_config(
            config,
            kv_manager=KVCacheManager(self.kv_pool.allocator, self.kv_pool.block_size),
            max_seq_len=self.max_seq_len,
        )
        if config.use_cuda_graphs and self.device.type != "cuda":
            raise EngineConfigError(
                f"use_cuda_graphs=True needs a CUDA device, the model is on {self.device}"
            )
        self.eos_token_ids = eos_token_ids_of(loaded_model)
        self.runner = ModelRunner(
            model,
            self.kv_pool,
            max_batch_size=config.max_batch_size,
            max_seq_len=self.max_seq_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            use_cuda_graphs=config.use_cuda_graphs,
            cuda_graph_mixed_steps=config.cuda_graph_mixed_steps,
            async_scheduling=config.async_scheduling,
            eos_token_ids=self.eos_token_ids,
        )
        # At start-up, not on first use: a kernel compile or a graph capture would land on the
        # latency of whichever request first needs it, and of every request in its step.
        self.runner.warm_up()
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()
        self._vocab_size = model.config.vocab_size
        # Guards the inbox and the live set, which other threads touch through add_request/abort.
        self._lock = threading.Lock()
        self._incoming: deque[Request] = deque()
        self._abort_ids: list[str] = []
        self._live: dict[str, Request] = {}
        # Decisions launched on the runner whose outputs are not collected yet (async scheduling
        # keeps one).
        self._launched: deque = deque()
        self._num_added = 0
        self._counters = dict.fromkeys(
            ["num_steps", "prompt_tokens", "generation_tokens", "finished", "aborted", "failed", "preempted"],
            0,
        )
        self._busy_time_s = 0.0
        # Busy time of the steps that ran prompt tokens (a mixed step counts whole).
        self._prefill_time_s = 0.0

    # -- what the server calls --------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a request; returns its id. A str prompt is encoded with the tokenizer's special
        tokens (BOS); a chat prompt rendered by our templates should come as ids. Raises
        RequestTooLongError (ValueError) when it can never fit, ValueError for bad ids, and
        QueueFullError when max_queue_len requests already wait."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_ids = [int(token_id) for token_id in prompt]
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        bad = [token_id for token_id in prompt_ids if not 0 <= token_id < self._vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self._vocab_size}), got {bad[:5]}")
        outside = [token_id for token_id in params.logit_bias if token_id >= self._vocab_size]
        if outside:
            raise InvalidParamError(
                "logit_bias", f"logit_bias token ids must be in [0, {self._vocab_size}), got {outside[:5]}"
            )
        self.scheduler.check_fits(len(prompt_ids), params.max_new_tokens)
        with self._lock:
            request_id = request_id if request_id is not None else f"req-{self._num_added}"
            if request_id in self._live:
                raise ValueError(
                    f"request id {request_id!r} is already queued or running; ids must be unique"
                )
            num_waiting = self.scheduler.num_waiting + len(self._incoming)
            if num_waiting >= self.config.max_queue_len:
                raise QueueFullError(
                    f"{num_waiting} requests are waiting, the limit max_queue_len is "
                    f"{self.config.max_queue_len}; retry later"
                )
            request = Request(
                request_id, prompt_ids, params, arrival_index=self._num_added, arrival_s=time.monotonic()
            )
            self._num_added += 1
            self._prepare(request)
            self._live[request_id] = request
            self._incoming.append(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Asks for `request_id` to stop; the next step frees its blocks and yields its final
        StepOutput (finish_reason "abort"). False when the id is unknown or already finished."""
        with self._lock:
            if request_id not in self._live:
                return False
            if request_id not in self._abort_ids:
                self._abort_ids.append(request_id)
            return True

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._incoming or self._abort_ids)
        return pending or self.scheduler.has_work() or bool(self._launched)

    def step(self) -> list[StepOutput]:
        """One scheduler iteration; returns every StepOutput it produced (one per new token, plus
        final outputs of aborted and failed requests), in a deterministic order. With
        config.async_scheduling the tokens are those of the previous step: this step is launched
        on the device first, so that the host's work overlaps the device's."""
        started = time.perf_counter()
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            abort_ids, self._abort_ids = self._abort_ids, []
        for request in incoming:
            self.scheduler.add(request)
        outputs = [output for output in map(self._abort, abort_ids) if output is not None]
        decision = self.scheduler.schedule()
        self._counters["preempted"] += len(decision.preempted_request_ids)
        for new_request in decision.new_requests:
            request = self.scheduler.get(new_request.request_id)
            if request.first_scheduled_s is None:  # not a preempted request coming back
                request.first_scheduled_s = time.monotonic()
        finished: list[str] = []
        num_prompt_tokens = self._num_prompt_tokens(decision)
        try:
            self.runner.launch(decision)
        except Exception as error:  # noqa: BLE001 - a failed forward fails its step's requests, not the engine
            outputs += self._fail(decision, error, finished)
        else:
            self._launched.append(decision)
            self._counters["prompt_tokens"] += num_prompt_tokens
        # Async scheduling leaves the latest step running while it has work; otherwise, and to
        # drain, every launched step is collected.
        keep = 1 if self.config.async_scheduling and not decision.is_empty else 0
        while len(self._launched) > keep:
            outputs += self._collect(self._launched.popleft(), finished)
        for request_id in finished:
            self.scheduler.finish(request_id)
        with self._lock:
            for request_id in finished:
                self._live.pop(request_id, None)
        if outputs or not decision.is_empty:
            self._counters["num_steps"] += 1
            step_time_s = time.perf_counter() - started
            self._busy_time_s += step_time_s
            if num_prompt_tokens:
                self._prefill_time_s += step_time_s
        return outputs

    def stats(self) -> EngineStats:
        with self._lock:
            num_incoming = len(self._incoming)
        allocator = self.kv_pool.allocator
        busy, prefill = self._busy_time_s, self._prefill_time_s
        counters = self._counters
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + num_incoming,
            kv_usage_ratio=allocator.usage_ratio,
            kv_bytes_used=allocator.num_used * self.kv_pool.shape.bytes_per_block(),
            kv_bytes_total=self.kv_pool.kv_bytes,
            num_steps=counters["num_steps"],
            num_prompt_tokens_total=counters["prompt_tokens"],
            num_generation_tokens_total=counters["generation_tokens"],
            num_finished=counters["finished"],
            num_aborted=counters["aborted"],
            num_failed=counters["failed"],
            num_preempted=counters["preempted"],
            busy_time_s=busy,
            prompt_tokens_per_s=counters["prompt_tokens"] / prefill if prefill else 0.0,
            generation_tokens_per_s=counters["generation_tokens"] / busy if busy else 0.0,
        )

    # -- internals --------------------------------------------------------------------------

    def _num_prompt_tokens(self, decision) -> int:
        """Scheduled tokens that are prompt (or recompute) work: all but decodes of a sampled token."""
        computed_before = {
            running.request_id: running.num_computed_tokens for running in decision.running_requests
        }
        total = 0
        for request_id, n in decision.num_scheduled_tokens.items():
            # A new or resumed request (not in running_requests) computes prompt or recompute work.
            computed = computed_before.get(request_id, 0)
            is_decode = n == 1 and computed >= self.scheduler.get(request_id).num_prompt_tokens
            total += 0 if is_decode else n
        return total

    def _collect(self, decision, finished: list[str]) -> list[StepOutput]:
        """The StepOutputs of a launched step: its tokens through the stop checks."""
        try:
            runner_output = self.runner.collect()
        except Exception as error:  # noqa: BLE001 - as a failed launch
            return self._fail(decision, error, finished)
        outputs = []
        for request, token_ids in self.scheduler.update(decision, runner_output):
            if request.request_id in finished:
                continue  # it failed or stopped in this step() already
            for token_id in token_ids:
                outputs.append(self._accept_token(request, token_id, finished))
                if request.state is RequestState.FINISHED:
                    break
        return outputs

    def _prepare(self, request: Request) -> None:
        from infer.models.loader.tokenizer import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=request.prompt_ids)
        request.stop_checker = StopChecker(request.params, self.eos_token_ids, detokenizer)

    def _accept_token(self, request: Request, token_id: int, finished: list[str]) -> StepOutput:
        """`token_id` is already in request.output_ids (Scheduler.update); check stops on it."""
        self._counters["generation_tokens"] += 1
        text, finish_reason = request.stop_checker.push(token_id)
        if finish_reason is not None:
            request.state = RequestState.FINISHED
            request.finish_reason = finish_reason
            finished.append(request.request_id)
            self._counters["finished"] += 1
        return _step_output(request, token_id, text=text, finish_reason=finish_reason)

    def _abort(self, request_id: str) -> StepOutput | None:
        request = self.scheduler.finish(request_id)
        with self._lock:
            self._live.pop(request_id, None)
        if request is None:
            return None  # finished in the step that ran while the abort was asked for
        request.state = RequestState.FINISHED
        request.finish_reason = FINISH_ABORT
        self._counters["aborted"] += 1
        return _step_output(request, None, finish_reason=FINISH_ABORT)

    def _fail(self, decision, error: Exception, finished: list[str]) -> list[StepOutput]:
        """Fails the decision's requests that are still live."""
        requests = [
            request
            for request_id in decision.scheduled_request_ids
            if (request := self.scheduler.get(request_id)) is not None and request_id not in finished
        ]
        message = f"{type(error).__name__}: {error}"
        logger.exception("forward failed for %s", [request.request_id for request in requests])
        outputs = []
        for request in requests:
            request.state = RequestState.FAILED
            request.error = message
            finished.append(request.request_id)
            self._counters["failed"] += 1
            outputs.append(_step_output(request, None, error=message))
        return outputs


def _step_output(
    request: Request,
    token_id: int | None,
    *,
    text: str = "",
    finish_reason: str | None = None,
    error: str | None = None,
) -> StepOutput:
    """The one StepOutput builder: a token (with the text it releases), or a final word."""
    return StepOutput(
        request_id=request.request_id,
        token_id=token_id,
        text_delta=text,
        finished=finish_reason is not None or error is not None,
        finish_reason=finish_reason,
        error=error,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=len(request.output_ids),
        # The first token's step scheduled the request before, so the time is known by then.
        queue_time_s=(
            request.first_scheduled_s - request.arrival_s
            if token_id is not None and len(request.output_ids) == 1
            else None
        ),
    )


def _resolve_max_seq_len(config: EngineConfig, model_max_positions: int) -> int:
    if config.max_seq_len is None:
        return min(model_max_positions, DEFAULT_MAX_SEQ_LEN_CAP)
    if config.max_seq_len > model_max_positions:
        raise EngineConfigError(
            f"max_seq_len ({config.max_seq_len}) exceeds the model's max_position_embeddings "
            f"({model_max_positions}); lower max_seq_len"
        )
    return config.max_seq_len


def _build_kv_pool(config: EngineConfig, model, max_seq_len: int, device: torch.device) -> PagedKVPool:
    """The pool the config asks for: blocks of block_size (paged) or of max_seq_len (contiguous)."""
    block_size = config.block_size if config.kv_cache_backend == "paged" else max_seq_len
    shape = KVCacheShape(
        num_layers=model.config.num_layers,
        num_kv_heads=model.config.num_kv_heads,
        head_dim=model.config.head_dim,
        dtype=next(model.parameters()).dtype,
        block_size=block_size,
    )
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
    elif config.kv_cache_memory_fraction is not None:
        budget = kv_budget_from_free_memory(device, config.kv_cache_memory_fraction)
        num_blocks = num_blocks_for_memory(shape, budget)
    else:
        # The memory of max_batch_size whole sequences, as the slotted pool had.
        num_blocks = config.max_batch_size * shape.blocks_for_tokens(max_seq_len)
    if num_blocks < 1:
        raise EngineConfigError(f"the KV pool would hold {num_blocks} blocks; give it more memory")
    return PagedKVPool(shape, num_blocks=num_blocks, device=device)
