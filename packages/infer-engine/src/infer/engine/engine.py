"""Engine: requests in, one StepOutput per new token out, one scheduler iteration per `step()`.

Synchronous by design. The server calls `step()` in a loop from one dedicated thread while
`add_request` and `abort` may come from any thread: those two only validate and put the
request (or the abort) in an inbox under a lock, and the next `step()` takes the inbox in, so
the scheduler, the KV pool and the requests are touched by the stepping thread alone.

A step: take in new requests and aborts (an aborted request's slot is free before anything is
scheduled, and it gets a final StepOutput with finish_reason "abort"), ask the scheduler for a
decision, run its prefill chunks in one forward and its decodes in another, push each sampled
token through the request's StopChecker, then retire whatever finished. A forward that raises
fails only the requests of its batch (FAILED, error set, slots freed); the others go on.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from infer.cache import ContiguousKVCache, KVCacheShape, SlotAllocator, SlottedKVCache
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.cuda_graphs import DecodeGraphs
from infer.engine.eos import collect_eos_token_ids
from infer.engine.request import (
    FINISH_ABORT,
    QueueFullError,
    Request,
    RequestState,
    StepOutput,
)
from infer.engine.runner import ModelRunner
from infer.engine.sampler import make_generator
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.stop import StopChecker

logger = logging.getLogger(__name__)

# The default max_seq_len when the config gives none: the model's context, at most this, so the
# default pool (max_batch_size slots of max_seq_len) stays a few hundred MB for small models.
DEFAULT_MAX_SEQ_LEN_CAP = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    # Fraction of KV slots lent out; bytes count whole reserved slots.
    kv_usage_ratio: float
    kv_bytes_used: int
    kv_bytes_total: int
    num_steps: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_finished: int
    num_aborted: int
    num_failed: int
    # Wall time spent inside step() with work to do; the rates below are over it.
    busy_time_s: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float


class Engine:
    def __init__(self, config: EngineConfig, loaded_model=None):
        """`loaded_model`: an infer.models.LoadedModel; None loads config.model (its dtype and
        device then come from the config; a given model keeps its own)."""
        self.config = config
        if loaded_model is None:
            from infer.models.load import load_model

            loaded_model = load_model(
                config.model, dtype=_resolve_dtype(config), device=_resolve_device(config)
            )
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
        shape = KVCacheShape(
            num_layers=model.config.num_layers,
            num_kv_heads=model.config.num_kv_heads,
            head_dim=model.config.head_dim,
            max_seq_len=self.max_seq_len,
            dtype=parameter.dtype,
        )
        if config.kv_cache_backend == "slotted":
            self.kv_cache = SlottedKVCache(shape, num_slots=config.max_batch_size, device=self.device)
            self.kv_pool = self.kv_cache
        else:
            # Static batches only (EngineConfig says so): the allocator's lowest-first ids make a
            # fresh batch's row b use row b of the contiguous cache.
            self.kv_cache = ContiguousKVCache(shape, num_slots=config.max_batch_size, device=self.device)
            self.kv_pool = SlotAllocator(config.max_batch_size)
        self.scheduler = Scheduler.from_engine_config(
            config, kv_pool=self.kv_pool, max_seq_len=self.max_seq_len
        )
        decode_graphs = None
        if config.cuda_graphs:
            if self.device.type != "cuda":
                raise EngineConfigError(
                    f"cuda_graphs=True needs a CUDA device, the model is on {self.device}"
                )
            decode_graphs = DecodeGraphs(
                model,
                self.kv_cache.kv_layers,
                max_seq_len=self.max_seq_len,
                max_batch_size=config.max_batch_size,
            )
            # At start-up, not on first use: a capture takes tens of milliseconds, which would
            # land on the latency of whichever request first needs a new bucket.
            decode_graphs.capture_all()
        self.runner = ModelRunner(
            model, self.kv_cache.kv_layers, max_seq_len=self.max_seq_len, decode_graphs=decode_graphs
        )
        self.eos_token_ids = _eos_token_ids(loaded_model)
        self._vocab_size = model.config.vocab_size
        # Guards the inbox and the live set, which other threads touch through add_request/abort.
        self._lock = threading.Lock()
        self._incoming: deque[Request] = deque()
        self._abort_ids: list[str] = []
        self._live: dict[str, Request] = {}
        self._num_added = 0
        self._counters = dict.fromkeys(
            ["num_steps", "prompt_tokens", "generation_tokens", "finished", "aborted", "failed"], 0
        )
        self._busy_time_s = 0.0

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
            request = Request(request_id, prompt_ids, params, arrival_index=self._num_added)
            self._num_added += 1
            self._prepare(request)
            self._live[request_id] = request
            self._incoming.append(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Asks for `request_id` to stop; the next step frees its slot and yields its final
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
        return pending or self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One scheduler iteration; returns every StepOutput it produced (one per new token, plus
        final outputs of aborted and failed requests), in a deterministic order."""
        started = time.perf_counter()
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            abort_ids, self._abort_ids = self._abort_ids, []
        for request in incoming:
            self.scheduler.add(request)
        outputs = [output for output in map(self._abort, abort_ids) if output is not None]
        decision = self.scheduler.schedule()
        finished: list[str] = []
        if decision.prefills:
            work = [(self.scheduler.get(chunk.request_id), chunk) for chunk in decision.prefills]
            try:
                tokens = self.runner.prefill(work)
            except Exception as error:  # noqa: BLE001 - any forward failure fails its batch, not the engine
                outputs += self._fail([request for request, _ in work], error, finished)
            else:
                self._counters["prompt_tokens"] += sum(chunk.num_tokens for chunk in decision.prefills)
                for (request, _), token in zip(work, tokens, strict=True):
                    if token is not None:
                        outputs.append(self._accept_token(request, token, finished))
        if decision.decodes:
            requests = [self.scheduler.get(request_id) for request_id in decision.decodes]
            try:
                tokens = self.runner.decode(requests)
            except Exception as error:  # noqa: BLE001 - see above
                outputs += self._fail(requests, error, finished)
            else:
                for request, token in zip(requests, tokens, strict=True):
                    outputs.append(self._accept_token(request, token, finished))
        self.scheduler.update(decision, finished=finished)
        with self._lock:
            for request_id in finished:
                self._live.pop(request_id, None)
        if outputs or not decision.is_empty:
            self._counters["num_steps"] += 1
            self._busy_time_s += time.perf_counter() - started
        return outputs

    def stats(self) -> EngineStats:
        with self._lock:
            num_incoming = len(self._incoming)
        capacity = self.kv_pool.capacity
        num_used = capacity - self.kv_pool.num_free
        busy = self._busy_time_s
        counters = self._counters
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + num_incoming,
            kv_usage_ratio=num_used / capacity,
            kv_bytes_used=self.kv_cache.kv_bytes * num_used // capacity,
            kv_bytes_total=self.kv_cache.kv_bytes,
            num_steps=counters["num_steps"],
            num_prompt_tokens_total=counters["prompt_tokens"],
            num_generation_tokens_total=counters["generation_tokens"],
            num_finished=counters["finished"],
            num_aborted=counters["aborted"],
            num_failed=counters["failed"],
            busy_time_s=busy,
            prompt_tokens_per_s=counters["prompt_tokens"] / busy if busy else 0.0,
            generation_tokens_per_s=counters["generation_tokens"] / busy if busy else 0.0,
        )

    # -- internals --------------------------------------------------------------------------

    def _prepare(self, request: Request) -> None:
        from infer.models.loader.tokenizer import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=request.prompt_ids)
        request.stop_checker = StopChecker(request.params, self.eos_token_ids, detokenizer)
        # A request without its own seed draws from one derived from the engine seed and its
        # arrival, so the same seed and the same queue give the same tokens.
        seed = request.params.seed
        if seed is None:
            seed = (self.config.seed * 1_000_003 + request.arrival_index) % 2**63
        request.generator = make_generator(seed, self.device)

    def _accept_token(self, request: Request, token_id: int, finished: list[str]) -> StepOutput:
        request.output_ids.append(token_id)
        self._counters["generation_tokens"] += 1
        text, finish_reason = request.stop_checker.push(token_id)
        if finish_reason is not None:
            request.state = RequestState.FINISHED
            request.finish_reason = finish_reason
            finished.append(request.request_id)
            self._counters["finished"] += 1
        return StepOutput(
            request_id=request.request_id,
            token_id=token_id,
            text_delta=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            error=None,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=len(request.output_ids),
        )

    def _abort(self, request_id: str) -> StepOutput | None:
        request = self.scheduler.remove(request_id)
        with self._lock:
            self._live.pop(request_id, None)
        if request is None:
            return None  # finished in the step that ran while the abort was asked for
        request.state = RequestState.FINISHED
        request.finish_reason = FINISH_ABORT
        self._counters["aborted"] += 1
        return StepOutput(
            request_id=request_id,
            token_id=None,
            text_delta="",
            finished=True,
            finish_reason=FINISH_ABORT,
            error=None,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=len(request.output_ids),
        )

    def _fail(self, requests: list[Request], error: Exception, finished: list[str]) -> list[StepOutput]:
        message = f"{type(error).__name__}: {error}"
        logger.exception("forward failed for %s", [request.request_id for request in requests])
        outputs = []
        for request in requests:
            request.state = RequestState.FAILED
            request.error = message
            finished.append(request.request_id)
            self._counters["failed"] += 1
            outputs.append(
                StepOutput(
                    request_id=request.request_id,
                    token_id=None,
                    text_delta="",
                    finished=True,
                    finish_reason=None,
                    error=message,
                    prompt_tokens=request.num_prompt_tokens,
                    completion_tokens=len(request.output_ids),
                )
            )
        return outputs


def _resolve_device(config: EngineConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def _resolve_dtype(config: EngineConfig) -> torch.dtype | None:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    # On the CPU half precision is slow and gains nothing; on CUDA keep the checkpoint's dtype.
    return torch.float32 if _resolve_device(config) == "cpu" else None


def _resolve_max_seq_len(config: EngineConfig, model_max_positions: int) -> int:
    if config.max_seq_len is None:
        return min(model_max_positions, DEFAULT_MAX_SEQ_LEN_CAP)
    if config.max_seq_len > model_max_positions:
        raise EngineConfigError(
            f"max_seq_len ({config.max_seq_len}) exceeds the model's max_position_embeddings "
            f"({model_max_positions}); lower max_seq_len"
        )
    return config.max_seq_len


def _eos_token_ids(loaded) -> frozenset[int]:
    # The same union SingleRequestGenerator.from_loaded collects (infer.engine.eos).
    end_of_turn = getattr(loaded.chat_template, "end_of_turn_token", None) if loaded.chat_template else None
    return collect_eos_token_ids(
        loaded.path,
        tokenizer_eos_token_id=loaded.tokenizer.eos_token_id,
        end_of_turn_token_id=loaded.tokenizer.token_id(end_of_turn) if end_of_turn else None,
    )
