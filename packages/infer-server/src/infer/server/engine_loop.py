"""The one thread that reads the engine's steps, and the channel from it to each request's HTTP handler.

`Engine.step(wait_s)` returns the StepOutputs of the core's next step (one per new token), with
the text already made by the engine's output processor. `EngineLoop` calls it in a loop on a
dedicated thread, so neither a forward (a core in this process) nor detokenizing blocks the
asyncio event loop. With the core in a child process (`Engine.spawn`, `infer serve`'s default)
this thread only reads what the core sent and makes text, while the core steps on by itself.
Requests and aborts go in through `Engine.add_request` / `Engine.abort`, which only check and
send. Outputs come back once per step through `loop.call_soon_threadsafe`, and `_dispatch` (on
the event loop) puts each into its request's `RequestHandle`.

The metrics of a request (time to first token, inter-token latency, finish reason, token counts)
are recorded in `_dispatch` from the step's arrival time; the gauges (running, waiting, KV use)
from the statistics the core sends with every step. The dashboard's statistics
(infer.server.stats) are fed at the same two places. The gauges are refreshed after a step at
most every GAUGE_REFRESH_S, whenever the engine is idle, and when they are read (/metrics,
/v1/stats: `refresh_gauges`), so a reader always sees the latest step's figures while a busy
engine's hundreds of steps a second do not each pay for them on the thread that makes text.
"""

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

from infer.engine.client import EngineDeadError
from infer.engine.images import PromptImage
from infer.engine.output_processor import StepOutput
from infer.engine.protocol import FINISH_ABORT, FINISH_ERROR
from infer.engine.sampling_params import SamplingParams
from infer.server.chat_output import FINISH_TOOL_CALLS
from infer.server.metrics import ServerMetrics
from infer.server.stats import ServerStats, request_record

logger = logging.getLogger(__name__)

# How long one read waits for a step when the core is idle; new work wakes it at once, so this
# only bounds how late a stop request is noticed.
IDLE_WAIT_S = 0.1
# How often a busy engine's steps refresh the gauges and the dashboard's 1 Hz histories (their
# point a second is the highest of ~20 samples). Refreshing after every step cost the frontend
# process 11% of its CPU in a profile of a served run (SmolLM2 on a 2-core CPU), time taken from
# the event loop that streams the answers (docs/benchmarks/serving.md#the-frontends-cpu).
GAUGE_REFRESH_S = 0.05


class RequestHandle:
    """One request's outputs, in generation order, as the event loop receives them."""

    def __init__(self, request_id: str, arrival_s: float):
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        # Resolved with the final StepOutput (finished, aborted or failed).
        self.done: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.queue_s: float | None = None
        self.vision_encoder_s: float | None = None
        self.client_gone = False
        # Set when the request ended because the engine itself failed (not its batch's forward).
        self.engine_failed = False
        # EngineLoop.answered for this handle (None for a handle made outside an EngineLoop).
        self._on_answer = None

    def answered(self, finish_reason: str) -> None:
        """The finish_reason its client got, once the answer is made: the statistics record the
        engine's until then, and a chat answer that became tool calls reads "tool_calls"."""
        if self._on_answer is not None:
            self._on_answer(self, finish_reason)

    @property
    def finished(self) -> bool:
        return self.done.done()


class EngineLoop:
    """Owns the engine thread; every public method is called from the event loop."""

    def __init__(
        self,
        engine,
        metrics: ServerMetrics,
        loop: asyncio.AbstractEventLoop,
        stats: ServerStats | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.stats = stats if stats is not None else ServerStats()
        self._loop = loop
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infer-engine-loop", daemon=True)
        # Set (on the event loop) when step() itself raised: the engine's state is unknown, so
        # the server stops serving and /health reports it.
        self.failure: str | None = None
        self._speculates = False  # True once the speculative-decoding metrics exist (start)
        self._sees = False  # True once the vision metrics exist (start: a vision-language model)
        self._offloads = False  # True once the host-tier metrics exist (start: kv_host_cache_gib)
        # The engine thread and a reader of /metrics or /v1/stats both refresh the gauges.
        self._gauges_lock = threading.Lock()
        self._gauges_refreshed_s = float("-inf")

    def start(self) -> None:
        speculative = self.engine.config.speculative
        if speculative is not None:  # the counters exist only then, as vLLM's
            self.metrics.enable_spec_decode(speculative.num_speculative_tokens)
            self._speculates = True
        if self.engine.limits.image_token_id is not None:
            self.metrics.enable_vision()
            self.stats.enable_vision()
            self._sees = True
        if self.engine.config.kv_host_cache_gib is not None:
            self.metrics.enable_kv_host()
            self.stats.enable_kv_host()
            self._offloads = True
        if self.engine.config.data_parallel_size > 1:
            self.metrics.enable_replicas(self.engine.config.data_parallel_size)
        self.refresh_gauges()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)
        self.engine.shutdown()

    @property
    def num_live(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._handles)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        images: Sequence[PromptImage] = (),
    ) -> RequestHandle:
        """Queues a request in the engine (`images`: a vision-language model's, over their
        placeholder tokens). Raises what `Engine.add_request` raises (QueueFullError,
        RequestTooLongError, ValueError) and then has queued nothing."""
        handle = RequestHandle(request_id, time.monotonic())
        handle._on_answer = self._answered
        self.engine.add_request(
            prompt_ids, params, request_id=request_id, cache_salt=cache_salt, images=images
        )
        self._handles[request_id] = handle
        self.metrics.queue_depth.set(len(self._handles))
        return handle

    def abort(self, handle: RequestHandle, *, client_gone: bool) -> None:
        """Stops a request that has not finished; its slot is freed in the next step, which also
        sends its final output (finish_reason "abort"). `client_gone`: count it as a disconnect."""
        if handle.finished or handle.client_gone:
            return
        if client_gone:
            handle.client_gone = True
            self.metrics.client_disconnects_total.inc()
            self.stats.on_disconnect()
        self.engine.abort(handle.request_id)

    def abort_all(self) -> int:
        """Aborts every live request (the end of a drain); returns how many."""
        handles = [handle for handle in self._handles.values() if not handle.finished]
        for handle in handles:
            self.abort(handle, client_gone=False)
        return len(handles)

    def _answered(self, handle: RequestHandle, finish_reason: str) -> None:
        if finish_reason == FINISH_TOOL_CALLS:
            self.metrics.tool_call_answers_total.inc()
            self.stats.on_answer_finish_reason(handle.request_id, finish_reason)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                outputs = self.engine.step(wait_s=IDLE_WAIT_S)
            except EngineDeadError as error:  # its process died or hung: reported by /health
                logger.info("the engine is gone (%s); the server stops serving", error)
                self._call_soon(self._fail_all, str(error))
                return
            except Exception as error:  # noqa: BLE001 - reported to every waiting request, then stop
                logger.exception("engine step failed; the server stops serving")
                self._call_soon(self._fail_all, f"{type(error).__name__}: {error}")
                return
            step_done_s = time.monotonic()
            if not outputs or step_done_s - self._gauges_refreshed_s >= GAUGE_REFRESH_S:
                self.refresh_gauges()
            if outputs:
                self._call_soon(self._dispatch, outputs, step_done_s)

    def _call_soon(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop closed during shutdown: nobody is waiting any more
            self._stopping.set()

    def refresh_gauges(self) -> None:
        """Sets the gauges (and feeds the dashboard's statistics) from the core's latest step.
        Called from the engine thread and from the event loop (before /metrics and /v1/stats)."""
        with self._gauges_lock:
            self._update_gauges()
            self._gauges_refreshed_s = time.monotonic()

    def _update_gauges(self) -> None:
        stats = self.engine.stats()
        self.stats.on_engine_stats(stats)
        metrics = self.metrics
        metrics.requests_running.set(stats.num_running)
        metrics.requests_waiting.set(stats.num_waiting)
        metrics.kv_cache_usage_ratio.set(stats.kv_usage_ratio)
        metrics.kv_cache_used_bytes.set(stats.kv_bytes_used)
        metrics.kv_cache_total_bytes.set(stats.kv_bytes_total)
        metrics.prefill_tokens_per_second.set(stats.prompt_tokens_per_s)
        metrics.decode_tokens_per_second.set(stats.generation_tokens_per_s)
        metrics.decode_read_bytes_total.set_total(stats.decode_bytes_total)
        metrics.decode_seconds_total.set_total(stats.decode_time_s_total)
        metrics.copy_bandwidth_bytes_per_second.set(stats.copy_bandwidth_bytes_per_s)
        if self.engine.config.use_prefix_caching:  # otherwise they stay 0: skip them every step
            self._update_prefix_cache_gauges(stats)
        if self._speculates:
            metrics.update_spec_decode(stats)
        if self._sees:
            metrics.update_vision(stats)
        if self._offloads:
            metrics.update_kv_host(stats)
        if (replica_stats := self.engine.replica_stats()) is not None:
            alive = self.engine.replicas_alive()
            metrics.update_replicas(replica_stats, alive, self.engine.num_routed_by_prefix())
            self.stats.on_replica_stats(replica_stats, alive)

    def _update_prefix_cache_gauges(self, stats) -> None:
        metrics = self.metrics
        for kind, count in stats.prefix_cache_matches.items():
            metrics.prefix_cache_matches_total.set_total(count, kind=kind)
        metrics.prefix_cache_used_bytes.set(stats.prefix_cache_bytes)
        metrics.prefix_cache_budget_bytes.set(stats.prefix_cache_budget_bytes)
        metrics.prefix_cache_blocks.set(stats.prefix_cache_blocks)
        if stats.prefix_cache_num_entries is not None:
            metrics.prefix_cache_entries.set(stats.prefix_cache_num_entries)
        metrics.prefix_cache_evictions_total.set_total(stats.prefix_cache_evicted_blocks)
        metrics.prefix_cache_evicted_bytes_total.set_total(stats.prefix_cache_evicted_bytes)
        metrics.prefix_cache_quantized_bytes.set(stats.prefix_cache_quantized_bytes)
        metrics.prefix_cache_quantized_blocks_total.set_total(stats.prefix_cache_quantized_total)
        metrics.prefix_cache_restored_blocks_total.set_total(stats.prefix_cache_restored_total)
        metrics.prefix_cache_shadow_runs_total.set_total(stats.prefix_cache_shadow_runs)
        metrics.prefix_cache_shadow_divergences_total.set_total(stats.prefix_cache_shadow_divergences)

    # -- the event loop ---------------------------------------------------------------------

    def _dispatch(self, outputs: list[StepOutput], step_done_s: float) -> None:
        metrics = self.metrics
        num_tokens = 0
        # A step may give a request several tokens (a verified speculative run): each counts as
        # an inter-token latency of the gap since the request's previous step over their number.
        tokens_in_step = Counter(output.request_id for output in outputs if output.token_id is not None)
        latency_per_token: dict[str, float] = {}
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if output.token_id is not None:
                num_tokens += 1
                if handle.last_token_s is None:
                    metrics.time_to_first_token_seconds.observe(step_done_s - handle.arrival_s)
                    handle.first_token_s = step_done_s
                    if output.queue_time_s is not None:
                        metrics.request_queue_time_seconds.observe(output.queue_time_s)
                        handle.queue_s = output.queue_time_s
                    if output.vision_encoder_s is not None and self._sees:
                        metrics.request_vision_encoder_seconds.observe(output.vision_encoder_s)
                        handle.vision_encoder_s = output.vision_encoder_s
                else:
                    latency = latency_per_token.setdefault(
                        output.request_id,
                        (step_done_s - handle.last_token_s) / tokens_in_step[output.request_id],
                    )
                    metrics.inter_token_latency_seconds.observe(latency)
                handle.last_token_s = step_done_s
            handle.outputs.put_nowait(output)
            if output.finished:
                del self._handles[output.request_id]
                handle.done.set_result(output)
                self.stats.on_finished(_record(handle, output, self.stats.clock()))
                metrics.request_latency_seconds.observe(step_done_s - handle.arrival_s)
                metrics.requests_total.inc(finish_reason=output.finish_reason or FINISH_ERROR)
                metrics.prompt_tokens_total.inc(output.prompt_tokens)
                metrics.generation_tokens_total.inc(output.completion_tokens)
                # Counted with the prefix cache off too (then nothing is cached and every prompt
                # token is prefilled), as /v1/stats counts them.
                metrics.prompt_tokens_cached_total.inc(output.cached_tokens)
                metrics.prompt_tokens_prefilled_total.inc(output.prompt_tokens - output.cached_tokens)
                if self.engine.config.use_prefix_caching:
                    self._observe_cached(output)
        metrics.queue_depth.set(len(self._handles))
        if num_tokens:
            self.stats.on_tokens(num_tokens)

    def _observe_cached(self, final: StepOutput) -> None:
        metrics, cached = self.metrics, final.cached_tokens
        metrics.prefix_cache_cached_tokens.observe(cached)
        if final.prompt_tokens:
            metrics.prefix_cache_cached_ratio.observe(cached / final.prompt_tokens)

    def _fail_all(self, message: str) -> None:
        self.failure = message
        for handle in self._handles.values():
            handle.engine_failed = True
        finals = [StepOutput(request_id, None, "", True, None, message, 0, 0) for request_id in self._handles]
        self._dispatch(finals, time.monotonic())


def _record(handle: RequestHandle, final: StepOutput, finished_at: float):
    """The finished request's statistics: an abort is "cancelled" (its client went away, or the
    server drained), a failure "error"."""
    if final.finish_reason is None:
        reason = FINISH_ERROR
    elif final.finish_reason == FINISH_ABORT:
        reason = "cancelled"
    else:
        reason = final.finish_reason
    return request_record(
        handle.request_id,
        finished_at=finished_at,
        finish_reason=reason,
        prompt_tokens=final.prompt_tokens,
        cached_tokens=final.cached_tokens,
        completion_tokens=final.completion_tokens,
        arrival_s=handle.arrival_s,
        first_token_s=handle.first_token_s,
        last_token_s=handle.last_token_s,
        queue_s=handle.queue_s,
        vision_encoder_s=handle.vision_encoder_s,
    )
