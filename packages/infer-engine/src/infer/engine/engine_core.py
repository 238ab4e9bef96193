"""EngineCore: token ids in, token ids out, one scheduler iteration per `step()`.

Single-threaded and lock-free: whoever owns a core calls `add`, `abort` and `step` from one
thread (`infer.engine.client` puts it in the frontend's thread or in a child process). It knows
no text: requests come tokenized (`EngineRequest`), and each step answers `EngineOutputs`, the
new token ids of every request that got some, the requests that ended and why, and the core's
statistics. Stop strings are the frontend's; the token rules (EOS, stop token ids,
max_new_tokens) are the core's (`infer.engine.stop.token_finish_reason`).

A step: ask the scheduler for a decision (`infer.engine.decision`), launch every scheduled token
in one forward (`ModelRunner.launch`), collect the sampled tokens (`ModelRunner.collect`), apply
the token rules, then retire whatever finished. With `async_scheduling` a step collects the
previous step's tokens instead of its own, after launching its own: the device runs step k while
the host applies step k-1's tokens and schedules step k + 1. A request that stops on a token is
then already scheduled once more; that step's token for it is dropped. A forward that raises
fails only the requests of its step (FinishReason.ERROR, error set, blocks freed); the core goes
on. A request the core refuses (too long, queue full, bad ids) ends the same way in the next step.
"""

import logging
import math
import random
import time
from collections import deque
from collections.abc import Sequence

import torch

from infer.cache import (
    KVCacheShape,
    PagedKVPool,
    PrefixTree,
    QuantizedKVStore,
    kv_budget_from_free_memory,
    num_blocks_for_memory,
)
from infer.engine.config import EngineConfig, EngineConfigError, resolve_device, resolve_dtype
from infer.engine.device_defaults import resolve_for_device
from infer.engine.eos import eos_token_ids_of
from infer.engine.kv_manager import KVCacheManager
from infer.engine.memory import DeviceMemory, weights_bytes
from infer.engine.protocol import (
    ENTRIES_SENT,
    CoreLimits,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    FinishReason,
    PrefixCacheEntry,
    TokenLogprobs,
)
from infer.engine.request import Request, RequestState
from infer.engine.roofline import DecodeTraffic, copy_bandwidth
from infer.engine.runner import ModelRunner
from infer.engine.scheduler import Scheduler
from infer.engine.stop import stop_token_ids_of, token_finish_reason
from infer.engine.structured_output import StructuredOutput
from infer.models.kernel_policy import KernelPolicy

logger = logging.getLogger(__name__)

# The default max_seq_len when the config gives none: the model's context, at most this, so the
# default pool (room for max_batch_size sequences of max_seq_len) stays small for small models.
DEFAULT_MAX_SEQ_LEN_CAP = 4096
# The prefix cache's entries are walked once a second while the engine works, and never for more
# than this share of the time: a walk costs about 0.15 us a block held (14 ms for 93k blocks on
# this project's 2-core CI machine), and the next one then waits 1.4 s.
ENTRIES_PERIOD_S = 1.0
ENTRIES_MAX_TIME_SHARE = 0.01


class EngineCore:
    def __init__(self, config: EngineConfig, loaded_model=None):
        """`loaded_model`: an infer.models.LoadedModel; None loads config.model (its dtype and
        device then come from the config; a given model keeps its own). The config's auto
        settings are decided for the device (infer.engine.device_defaults): `self.config` holds
        the result, and `self.settings_line` says it in one line."""
        device = (
            resolve_device(config.device)
            if loaded_model is None
            else next(loaded_model.model.parameters()).device
        )
        resolved = resolve_for_device(config, device)
        config = self.config = resolved.config
        self.settings_line = resolved.describe()
        logger.info("engine settings: %s", self.settings_line)
        if loaded_model is None:
            from infer.models.load import load_model

            limit_device_memory(config, device)
            loaded_model = load_model(
                config.model,
                dtype=resolve_dtype(config.dtype, device),
                device=device,
                quantization=config.quantization,
            )
        else:
            logger.info(
                "engine uses the given model from %s; config.model/dtype/device are not used",
                loaded_model.path,
            )
            limit_device_memory(config, next(loaded_model.model.parameters()).device)
        # Kept for the frontend that shares this process (its tokenizer and template); the core
        # itself reads only the model and the folder's EOS declarations.
        self.loaded = loaded_model
        model = loaded_model.model
        self.device = next(model.parameters()).device
        self.max_seq_len = _resolve_max_seq_len(config, model.config.max_position_embeddings)
        # Measured before the KV pool takes the free memory (it borrows two large buffers).
        self.copy_bandwidth = copy_bandwidth(self.device)
        self.kv_pool = _build_kv_pool(config, model, self.max_seq_len, self.device)
        self.decode_traffic = DecodeTraffic.of(model, self.kv_pool.shape.dtype)
        # Decode steps that ran back to back: what they read and took (EngineStats.decode_*).
        self._previous_decode: tuple[float, int] | None = None  # (started, bytes) of the last step
        self._decode_bytes_total = 0
        self._decode_time_s_total = 0.0
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f MiB)",
            self.kv_pool.num_blocks,
            self.kv_pool.block_size,
            self.kv_pool.kv_bytes / 2**20,
        )
        self.prefix_tree = _build_prefix_tree(config, self.kv_pool)
        self._last_idle_eviction_s = time.perf_counter()
        # Walks of the tree's entries (_prefix_cache_entries): when the last began and how long it
        # took, and whether the tree has been walked since the engine last fell idle.
        self._entries_walked_s = -math.inf
        self._entries_walk_s = 0.0
        self._entries_idle_walked = False
        # Shadow re-runs (prefix_cache_shadow_rate): (prompt, params, salt, tokens the cached run
        # gave) waiting for an idle engine, and the live ones by id -> those tokens.
        self._shadow_rng = random.Random(config.seed)
        self._shadow_queue: deque[tuple[list[int], object, str | None, list[int]]] = deque()
        self._shadows: dict[str, list[int]] = {}
        self._num_shadows_started = 0
        self.scheduler = Scheduler.from_engine_config(
            config,
            kv_manager=KVCacheManager(self.kv_pool.allocator, self.kv_pool.block_size, self.prefix_tree),
            max_seq_len=self.max_seq_len,
        )
        for name in ("use_cuda_graphs", "use_pdl", "use_triton_gemv"):
            if getattr(config, name) and self.device.type != "cuda":
                raise EngineConfigError(f"{name}=True needs a CUDA device, the model is on {self.device}")
        eos_token_ids = eos_token_ids_of(loaded_model)
        self.limits = CoreLimits(
            max_seq_len=self.max_seq_len,
            block_size=self.kv_pool.block_size,
            num_blocks=self.kv_pool.num_blocks,
            max_queue_len=config.max_queue_len,
            vocab_size=model.config.vocab_size,
            eos_token_ids=eos_token_ids,
            config=config,
            settings_line=self.settings_line,
        )
        # Structured output: a matcher per constrained request.
        self.structured_output = StructuredOutput(
            loaded_model.tokenizer.hf_tokenizer,
            model.config.vocab_size,
            eos_token_ids,
            self.device,
            config.max_batch_size,
        )
        self.runner = ModelRunner(
            model,
            self.kv_pool,
            max_batch_size=config.max_batch_size,
            max_seq_len=self.max_seq_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            use_cuda_graphs=config.use_cuda_graphs,
            cuda_graph_mixed_steps=config.cuda_graph_mixed_steps,
            async_scheduling=config.async_scheduling,
            kernel_policy=KernelPolicy(
                self.device, config.use_triton_gemv, config.use_pdl, config.use_native_cpu_kernels
            ),
            eos_token_ids=eos_token_ids,
        )
        # At start-up, not on first use: a kernel compile or a graph capture would land on the
        # latency of whichever request first needs it, and of every request in its step.
        started = time.perf_counter()
        self.runner.warm_up()
        logger.info("warmed up the kernels in %.1f s", time.perf_counter() - started)
        if self.runner.graphs is not None:
            started = time.perf_counter()
            logger.info("capturing CUDA graphs (use_cuda_graphs=false skips this)")
            self.runner.graphs.capture_all()
            logger.info(
                "captured %d CUDA graphs in %.1f s",
                self.runner.graphs.num_captured,
                time.perf_counter() - started,
            )
        # The weights do not change once the engine is built: counted once (EngineStats.weights_bytes).
        self.weights_bytes = weights_bytes(model)
        self.device_memory = DeviceMemory(self.device)
        # Final outputs decided outside a step (aborts, refusals), sent with the next step's.
        self._early_outputs: list[EngineOutput] = []
        # Decisions launched on the runner whose outputs are not collected yet (async scheduling
        # keeps one).
        self._launched: deque = deque()
        self._num_added = 0
        self._counters = dict.fromkeys(
            [
                "num_steps",
                "prompt_tokens",
                "generation_tokens",
                "finished",
                "aborted",
                "failed",
                "preempted",
                "shadow_runs",
                "shadow_divergences",
            ],
            0,
        )
        self._busy_time_s = 0.0
        # Busy time of the steps that ran prompt tokens (a mixed step counts whole).
        self._prefill_time_s = 0.0

    # -- what the owner calls -----------------------------------------------------------------

    def add(self, engine_request: EngineRequest) -> None:
        """Queues a request. One the core cannot take (see CoreLimits.check_request, a full queue,
        an id in use) ends with FinishReason.ERROR in the next step's outputs."""
        prompt_ids = list(engine_request.prompt_token_ids)
        request = Request(
            engine_request.request_id,
            prompt_ids,
            engine_request.sampling,
            arrival_index=self._num_added,
            arrival_s=engine_request.arrival_s,
            stop_token_ids=stop_token_ids_of(engine_request.sampling, self.limits.eos_token_ids),
            cache_salt=engine_request.cache_salt,
        )
        self._num_added += 1
        try:
            self.limits.check_request(prompt_ids, engine_request.sampling)
            grammar = engine_request.sampling.grammar
            matcher = self.structured_output.matcher(grammar) if grammar is not None else None
            self.scheduler.add(request)
            if matcher is not None:
                self.structured_output.add(request.request_id, matcher)
        except (ValueError, RuntimeError) as error:  # QueueFullError is a RuntimeError
            logger.info("refused request %s: %s", request.request_id, error)
            request.error = f"{type(error).__name__}: {error}"
            self._early_outputs.append(_output(request, [], FinishReason.ERROR))

    def abort(self, request_ids) -> None:
        """Ends these requests now (their blocks are free at once); each gets a final output
        (FinishReason.ABORT) with the next step. Ids unknown or finished are ignored."""
        for request_id in request_ids:
            self.structured_output.remove(request_id)
            request = self.scheduler.finish(request_id)
            if request is None:
                continue  # finished in an earlier step, or never here
            request.state = RequestState.FINISHED
            request.finish_reason = FinishReason.ABORT
            self._counters["aborted"] += 1
            self._early_outputs.append(_output(request, [], FinishReason.ABORT))

    def has_work(self) -> bool:
        """Something to step: outputs to send, requests, a launched step, or a shadow re-run."""
        return (
            bool(self._early_outputs)
            or self.scheduler.has_work()
            or bool(self._launched)
            or bool(self._shadow_queue)
        )

    def step(self) -> EngineOutputs:
        """One scheduler iteration: the outputs it produced, in a deterministic order, and the
        statistics after it. With config.async_scheduling the tokens are those of the previous
        step: this step is launched on the device first, so that the host's work overlaps it."""
        started = time.perf_counter()
        outputs, self._early_outputs = self._early_outputs, []
        if self._shadow_queue and not self.scheduler.has_work() and not self._launched:
            self._start_shadow()
        decision = self.scheduler.schedule()
        self._counters["preempted"] += len(decision.preempted_request_ids)
        for new_request in decision.new_requests:
            request = self.scheduler.get(new_request.request_id)
            if request.first_scheduled_s is None:  # not a preempted request coming back
                request.first_scheduled_s = time.monotonic()
        finished: list[str] = []
        num_prompt_tokens = self._num_prompt_tokens(decision)
        masks = None
        collected_for_masks: list[EngineOutput] = []
        if self.structured_output:
            masks = self.structured_output.allowed
            if self._launched and self.structured_output.constrains_any(decision.num_scheduled_tokens):
                # A grammar's mask needs its request's last token, which the step still running
                # (async scheduling) samples: that step is collected once this one's forward is
                # queued (the runner asks for the masks then), so the device runs the forward
                # while the host reads the tokens and fills the masks.
                def masks(sampling_ids):
                    while self._launched:
                        collected_for_masks.extend(self._collect(self._launched.popleft(), finished))
                    return self.structured_output.allowed(sampling_ids)

        decode_bytes = None
        try:
            self.runner.launch(decision, masks)
        except Exception as error:  # noqa: BLE001 - a failed forward fails its step's requests, not the engine
            outputs += collected_for_masks + self._fail(decision, error, finished)
        else:
            if not num_prompt_tokens and not decision.is_empty:
                decode_bytes = self._decode_bytes(decision)
            outputs += collected_for_masks
            self._launched.append(decision)
            self._counters["prompt_tokens"] += num_prompt_tokens
        # Async scheduling leaves the latest step running while it has work; otherwise, and to
        # drain, every launched step is collected.
        keep = 1 if self.config.async_scheduling and not decision.is_empty else 0
        while len(self._launched) > keep:
            outputs += self._collect(self._launched.popleft(), finished)
        for request_id in finished:
            self.structured_output.remove(request_id)
            request = self.scheduler.get(request_id)
            # A failed forward's K/V may be wrong: none of it goes to the prefix cache.
            self.scheduler.finish(
                request_id, cache=request is None or request.state is not RequestState.FAILED
            )
        if self.prefix_tree is not None and started - self._last_idle_eviction_s >= 1.0:
            self._last_idle_eviction_s = started
            self.prefix_tree.evict_idle(self.config.prefix_cache_ttl_s)
        if self._shadows:  # shadow re-runs are the core's own business
            outputs = [output for output in outputs if output.request_id not in self._shadows]
            for request_id in [rid for rid in self._shadows if self.scheduler.get(rid) is None]:
                del self._shadows[request_id]
        self._count_decode(started, decode_bytes)
        if outputs or not decision.is_empty:
            self._counters["num_steps"] += 1
            step_time_s = time.perf_counter() - started
            self._busy_time_s += step_time_s
            if num_prompt_tokens:
                self._prefill_time_s += step_time_s
        return EngineOutputs(outputs, self.stats())

    def stats(self) -> EngineStats:
        allocator = self.kv_pool.allocator
        busy, prefill = self._busy_time_s, self._prefill_time_s
        counters = self._counters
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage_ratio=allocator.usage_ratio,
            kv_bytes_used=allocator.num_used * self.kv_pool.shape.bytes_per_block(),
            kv_bytes_total=self.kv_pool.kv_bytes,
            num_steps=counters["num_steps"],
            num_added=self._num_added,
            num_prompt_tokens_total=counters["prompt_tokens"],
            num_generation_tokens_total=counters["generation_tokens"],
            num_finished=counters["finished"],
            num_aborted=counters["aborted"],
            num_failed=counters["failed"],
            num_preempted=counters["preempted"],
            busy_time_s=busy,
            prompt_tokens_per_s=counters["prompt_tokens"] / prefill if prefill else 0.0,
            generation_tokens_per_s=counters["generation_tokens"] / busy if busy else 0.0,
            decode_bytes_total=self._decode_bytes_total,
            decode_time_s_total=self._decode_time_s_total,
            copy_bandwidth_bytes_per_s=self.copy_bandwidth,
            weights_bytes=self.weights_bytes,
            **self.device_memory.stats(),
            **self._prefix_cache_stats(),
            **self._prefix_cache_entries(),
        )

    def _prefix_cache_stats(self) -> dict:
        tree = self.prefix_tree
        if tree is None:
            return {}
        block_bytes = self.kv_pool.shape.bytes_per_block()
        return dict(
            prefix_cache_matches=dict(self.scheduler.kv_manager.match_counts),
            prefix_cache_blocks=tree.num_blocks,
            prefix_cache_bytes=tree.num_blocks * block_bytes,
            prefix_cache_budget_bytes=(tree.max_blocks or 0) * block_bytes,
            prefix_cache_evicted_blocks=tree.num_evicted_blocks,
            prefix_cache_evicted_bytes=tree.num_evicted_blocks * block_bytes,
            prefix_cache_quantized_blocks=tree.num_quantized_blocks,
            prefix_cache_quantized_bytes=tree.num_quantized_blocks
            * QuantizedKVStore.bytes_per_slot(self.kv_pool.shape),
            prefix_cache_quantized_total=tree.num_quantized_total,
            prefix_cache_restored_total=tree.num_warmed_total,
            prefix_cache_shadow_runs=self._counters["shadow_runs"],
            prefix_cache_shadow_divergences=self._counters["shadow_divergences"],
        )

    def _prefix_cache_entries(self) -> dict:
        """The tree's entries when a walk is due, else nothing. A walk is due once a second while
        the engine works, and once when it falls idle (so that the last entries shown are the
        tree as it stays); never sooner after the last one than ENTRIES_MAX_TIME_SHARE allows."""
        if self.prefix_tree is None:
            return {}
        now = time.monotonic()  # the tree's clock (PrefixTree's default)
        since = now - self._entries_walked_s
        idle = not self.has_work()
        if not idle:
            self._entries_idle_walked = False
        due = since >= ENTRIES_PERIOD_S or (idle and not self._entries_idle_walked)
        if not due or since < self._entries_walk_s / ENTRIES_MAX_TIME_SHARE:
            return {}
        entries = self.prefix_tree.entries()
        self._entries_walked_s, self._entries_walk_s = now, time.monotonic() - now
        self._entries_idle_walked = idle
        entries.sort(key=lambda entry: entry.last_used_s, reverse=True)
        block_bytes = self.kv_pool.shape.bytes_per_block()
        slot_bytes = QuantizedKVStore.bytes_per_slot(self.kv_pool.shape)
        unix = time.time() - now  # monotonic -> Unix seconds
        return dict(
            prefix_cache_num_entries=len(entries),
            prefix_cache_entries=tuple(
                PrefixCacheEntry(
                    start=entry.start,
                    num_tokens=entry.num_tokens,
                    bytes=entry.num_blocks * block_bytes,
                    int8_bytes=entry.num_int8_blocks * slot_bytes,
                    hits=entry.hits,
                    created_at=unix + entry.created_s,
                    last_used_at=unix + entry.last_used_s,
                    in_use=entry.in_use,
                )
                for entry in entries[:ENTRIES_SENT]
            ),
        )

    # -- internals --------------------------------------------------------------------------

    def _decode_bytes(self, decision) -> int:
        """What the decode step `decision` reads: the weights, and each sequence's K/V (a decode
        step schedules running requests only)."""
        scheduled = decision.num_scheduled_tokens
        return self.decode_traffic.step_bytes(
            [
                running.num_computed_tokens + scheduled[running.request_id]
                for running in decision.running_requests
            ]
        )

    def _count_decode(self, started: float, decode_bytes: int | None) -> None:
        """Counts the previous step's bytes and its time (to this step's start) when both were
        decode steps: between those, nothing but decoding (no prompt, no idle wait) took time."""
        previous = self._previous_decode
        if previous is not None and decode_bytes is not None:
            self._decode_bytes_total += previous[1]
            self._decode_time_s_total += started - previous[0]
        self._previous_decode = None if decode_bytes is None else (started, decode_bytes)

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

    def _collect(self, decision, finished: list[str]) -> list[EngineOutput]:
        """The outputs of a launched step: its tokens through the token rules."""
        try:
            runner_output = self.runner.collect()
        except Exception as error:  # noqa: BLE001 - as a failed launch
            return self._fail(decision, error, finished)
        outputs = []
        for request, token_ids in self.scheduler.update(decision, runner_output):
            if request.request_id in finished:
                continue  # it failed or stopped in this step() already
            logprobs = runner_output.logprobs.get(request.request_id)
            outputs.append(self._accept_tokens(request, token_ids, finished, logprobs))
        return outputs

    def _accept_tokens(
        self,
        request: Request,
        token_ids: list[int],
        finished: list[str],
        logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> EngineOutput:
        """`token_ids` are already in request.output_ids (Scheduler.update); the token rules
        decide whether the request ends on one of them (what follows it is dropped).
        `logprobs`: one per token, when the request asked for them."""
        first = len(request.output_ids) - len(token_ids)
        accepted: list[int] = []
        reason = None
        for index, token_id in enumerate(token_ids):
            accepted.append(token_id)
            reason = token_finish_reason(request.params, request.stop_token_ids, first + index + 1, token_id)
            if reason is not None:
                break
        refused = self.structured_output.advance(request.request_id, accepted)
        if refused is not None:  # the mask allowed it: a bug, never the client's doing
            token_id = accepted[refused]
            logger.error("request %s: its grammar refused token %d", request.request_id, token_id)
            request.state = RequestState.FAILED
            request.error = f"GrammarError: the grammar refused sampled token {token_id}"
            reason = FinishReason.ERROR
            self._counters["failed"] += 1
            accepted = accepted[:refused]
        self._counters["generation_tokens"] += len(accepted)
        if reason is FinishReason.ERROR:
            finished.append(request.request_id)
        elif reason is not None:
            request.state = RequestState.FINISHED
            request.finish_reason = reason
            finished.append(request.request_id)
            self._finished_with(request, request.output_ids[: first + len(accepted)])
        accepted_logprobs = list(logprobs[: len(accepted)]) if logprobs is not None else None
        return _output(request, accepted, reason, first_token=first == 0, logprobs=accepted_logprobs)

    def _finished_with(self, request: Request, token_ids: list[int]) -> None:
        """Counts a request that ended on a token rule, and does the shadow check's part: a shadow
        re-run compares its tokens with the cached run's; a greedy request served from the cache
        may be picked for a re-run."""
        expected = self._shadows.get(request.request_id)
        if expected is not None:
            self._counters["shadow_runs"] += 1
            if list(token_ids) != expected:
                self._counters["shadow_divergences"] += 1
                logger.warning(
                    "prefix cache divergence: a request served from the cache gave %s, recomputed %s",
                    expected,
                    list(token_ids),
                )
            return
        self._counters["finished"] += 1
        rate = self.config.prefix_cache_shadow_rate
        if (
            rate
            and request.num_cached_tokens
            and request.params.is_greedy
            and self._shadow_rng.random() < rate
        ):
            self._shadow_queue.append(
                (list(request.prompt_ids), request.params, request.cache_salt, list(token_ids))
            )

    def _start_shadow(self) -> None:
        prompt_ids, params, salt, expected = self._shadow_queue.popleft()
        request_id = f"prefix-cache-shadow-{self._num_shadows_started}"
        self._num_shadows_started += 1
        request = Request(
            request_id,
            prompt_ids,
            params,
            arrival_index=self._num_added,
            arrival_s=time.monotonic(),
            stop_token_ids=stop_token_ids_of(params, self.limits.eos_token_ids),
            cache_salt=salt,
            bypass_prefix_cache=True,
        )
        self.scheduler.add(request)
        self._shadows[request_id] = expected

    def _fail(self, decision, error: Exception, finished: list[str]) -> list[EngineOutput]:
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
            outputs.append(_output(request, [], FinishReason.ERROR))
        return outputs


def _output(
    request: Request,
    token_ids: list[int],
    finish_reason: FinishReason | None,
    *,
    first_token: bool = False,
    logprobs: list[TokenLogprobs] | None = None,
) -> EngineOutput:
    """The one EngineOutput builder: tokens, a final word, or both."""
    return EngineOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        finish_reason=finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        error=request.error if finish_reason is FinishReason.ERROR else None,
        # The first token's step scheduled the request before, so the time is known by then.
        queue_time_s=(
            request.first_scheduled_s - request.arrival_s
            if first_token and token_ids and request.first_scheduled_s is not None
            else None
        ),
        logprobs=logprobs,
    )


def _build_prefix_tree(config: EngineConfig, kv_pool: PagedKVPool) -> PrefixTree | None:
    if not config.use_prefix_caching:
        return None
    max_blocks = None
    if config.prefix_cache_max_bytes is not None:
        max_blocks = config.prefix_cache_max_bytes // kv_pool.shape.bytes_per_block()
    return PrefixTree(
        kv_pool.allocator,
        kv_pool.block_size,
        max_blocks=max_blocks,
        slots=kv_pool.quantized.allocator if kv_pool.quantized is not None else None,
        quantize_min_tokens=config.prefix_cache_quantize_min_tokens,
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


def _memory_limit_bytes(config: EngineConfig) -> int | None:
    gib = config.device_memory_limit_gib
    return None if gib is None else int(gib * 2**30)


def limit_device_memory(config: EngineConfig, device: torch.device) -> None:
    """Holds this process's CUDA allocator to device_memory_limit_gib (it raises out-of-memory
    past it), so that everything the engine allocates counts: weights, KV pool, graphs."""
    limit = _memory_limit_bytes(config)
    if limit is None:
        return
    if device.type != "cuda":
        raise EngineConfigError(f"device_memory_limit_gib limits CUDA memory; the device is {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)


def _build_kv_pool(config: EngineConfig, model, max_seq_len: int, device: torch.device) -> PagedKVPool:
    """The pool the config asks for: blocks of block_size (paged) or of max_seq_len (contiguous)."""
    block_size = config.block_size if config.kv_cache_backend == "paged" else max_seq_len
    shape = KVCacheShape(
        num_layers=model.config.num_layers,
        num_kv_heads=model.config.num_kv_heads,
        head_dim=model.config.head_dim,
        dtype=model.dtype,
        block_size=block_size,
    )
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
    elif config.kv_cache_memory_fraction is not None:
        budget = kv_budget_from_free_memory(
            device, config.kv_cache_memory_fraction, memory_limit_bytes=_memory_limit_bytes(config)
        )
        num_blocks = num_blocks_for_memory(shape, budget)
    else:
        # The memory of max_batch_size whole sequences, as the slotted pool had.
        num_blocks = config.max_batch_size * shape.blocks_for_tokens(max_seq_len)
    num_slots = 0
    if config.prefix_cache_kv_bits is not None:
        # The int8 store's share of the same memory: fewer blocks, and slots in their bytes.
        num_store_blocks = round(num_blocks * config.prefix_cache_quantized_fraction)
        num_slots = num_store_blocks * shape.bytes_per_block() // QuantizedKVStore.bytes_per_slot(shape)
        num_blocks -= num_store_blocks
    if num_blocks < 1:
        raise EngineConfigError(f"the KV pool would hold {num_blocks} blocks; give it more memory")
    return PagedKVPool(shape, num_blocks=num_blocks, device=device, num_quantized_slots=num_slots)
