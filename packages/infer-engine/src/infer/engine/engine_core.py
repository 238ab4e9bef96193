"""EngineCore: token ids in, token ids out, one scheduler iteration per `step()`.

Single-threaded and lock-free: whoever owns a core calls `add`, `abort` and `step` from one
thread (`infer.engine.client` puts it in the frontend's thread or in a child process). It knows
no text: requests come tokenized (`EngineRequest`), and each step answers `EngineOutputs`, the
new token ids of every request that got some, the requests that ended and why, and the core's
statistics. Stop strings are the frontend's; the token rules (EOS, stop token ids,
max_new_tokens) are the scheduler's (`Scheduler.update`).

A step, as vLLM's: schedule (`Scheduler.schedule`), launch the forward of every scheduled token
(`ModelRunner.launch`), fill the grammar masks while the device computes
(`Scheduler.grammar_masks`), sample (`ModelRunner.sample`), collect the tokens
(`ModelRunner.collect`) and update (`Scheduler.update`: the token rules, the grammars, and the
requests that end finished), then hand the outputs to the observers (`infer.engine.observers`:
counters, decode bandwidth, the prefix cache's housekeeping and its shadow check). With
`async_scheduling` a step collects the previous step's tokens instead of its own, after launching
its own: the device runs step k while the host applies step k-1's tokens and schedules step
k + 1. A request that stops on a token is then already scheduled once more; that step's token
for it is dropped. A grammar's mask needs its request's last token: when the step still running
samples it, that step is collected once this one's forward is queued. A forward that raises
fails only the requests of its step (FinishReason.ERROR, error set, blocks freed); the core goes
on. A request the core refuses (too long, queue full, bad ids) ends the same way in the next step.
"""

import logging
import time
from collections import deque

from infer.engine.build import EngineParts, build_engine_parts
from infer.engine.config import EngineConfig
from infer.engine.decision import ScheduleDecision
from infer.engine.memory import DeviceMemory, weights_bytes
from infer.engine.observers import StepObserver
from infer.engine.observers.decode_bandwidth import DecodeBandwidth
from infer.engine.observers.prefix_cache import PrefixCacheObserver
from infer.engine.observers.prefix_cache_shadow import PrefixCacheShadow
from infer.engine.observers.step_counters import StepCounters
from infer.engine.protocol import EngineOutput, EngineOutputs, EngineRequest, EngineStats, FinishReason
from infer.engine.request import Request
from infer.engine.scheduler import request_output
from infer.engine.stop import stop_token_ids_of
from infer.engine.tensor_parallel import WorkerDiedError

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded_model=None, *, parts: EngineParts | None = None):
        """`loaded_model`: an infer.models.LoadedModel; None loads config.model (its dtype and
        device then come from the config; a given model keeps its own). `parts`: already built
        (`infer.engine.build.build_engine_parts`); then `loaded_model` is not used."""
        parts = parts if parts is not None else build_engine_parts(config, loaded_model)
        self.config = parts.config  # its auto settings decided for the device
        self.loaded = parts.loaded
        self.device = parts.device
        self.max_seq_len = parts.max_seq_len
        self.kv_pool = parts.kv_pool
        self.prefix_tree = parts.prefix_tree
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.limits = parts.limits
        self.copy_bandwidth = parts.copy_bandwidth
        self.decode_traffic = parts.decode_traffic
        # The weights do not change once the engine is built: counted once (EngineStats.weights_bytes).
        self.weights_bytes = weights_bytes(self.loaded.model)
        self.device_memory = DeviceMemory(self.device)
        speculative = self.config.speculative
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        # Final outputs decided outside a step (aborts, refusals), sent with the next step's.
        self._early_outputs: list[EngineOutput] = []
        # Decisions sampled on the runner whose outputs are not collected yet (async scheduling
        # keeps one).
        self._launched: deque[ScheduleDecision] = deque()
        self._num_added = 0
        self.observers = self._observers()

    def _observers(self) -> list[StepObserver]:
        """In the order they see a step: the shadow check takes its re-runs' outputs out first."""
        observers: list[StepObserver] = []
        if self.config.prefix_cache_shadow_rate:
            rate, seed = self.config.prefix_cache_shadow_rate, self.config.seed
            observers.append(PrefixCacheShadow(rate, seed, add=self._add, idle=self._idle))
        observers += [StepCounters(), DecodeBandwidth(self.decode_traffic, self.copy_bandwidth)]
        if self.prefix_tree is not None:
            kv_manager, ttl_s = self.scheduler.kv_manager, self.config.prefix_cache_ttl_s
            observers.append(
                PrefixCacheObserver(self.prefix_tree, self.kv_pool, kv_manager, ttl_s, self._idle)
            )
        return observers

    # -- what the owner calls -----------------------------------------------------------------

    def add(self, engine_request: EngineRequest) -> None:
        """Queues a request. One the core cannot take (see CoreLimits.check_request, a full queue,
        an id in use, a grammar it cannot enforce) ends with FinishReason.ERROR in the next
        step's outputs."""
        self._add(engine_request)
        self._num_added += 1

    def abort(self, request_ids) -> None:
        """Ends these requests now (their blocks are free at once); each gets a final output
        (FinishReason.ABORT) with the next step. Ids unknown or finished are ignored."""
        self._early_outputs += self.scheduler.abort(request_ids)

    def has_work(self) -> bool:
        """Something to step: outputs to send, requests, or a launched step."""
        return bool(self._early_outputs) or self.scheduler.has_work() or bool(self._launched)

    def step(self) -> EngineOutputs:
        """One scheduler iteration: the outputs it produced, in a deterministic order, and the
        statistics after it. With config.async_scheduling the tokens are those of the previous
        step: this step is launched on the device first, so that the host's work overlaps it."""
        started = time.perf_counter()
        outputs, self._early_outputs = self._early_outputs, []
        decision = self.scheduler.schedule()
        try:
            launch = self.runner.launch(decision)  # the forward is queued on the device
            if self.scheduler.constrains_any(decision):
                outputs += self._collect(keep=0)  # the masks need the running step's tokens
            self.runner.sample(launch, self.scheduler.grammar_masks(launch.sampling_ids, launch.drafts))
            self._launched.append(decision)
        except WorkerDiedError:
            raise  # the ranks cannot step together again: the engine ends
        except Exception as error:  # noqa: BLE001 - a failed forward fails its step's requests, not the engine
            outputs += self.scheduler.fail(decision, error)
        # Async scheduling leaves the latest step running while it has work; otherwise, to drain,
        # and around speculation (the next step's drafts continue this step's tokens; a verdict
        # decides how many tokens a request has), every launched step is collected.
        overlap = not decision.is_empty and not self.scheduler.speculates_after(decision)
        outputs += self._collect(keep=1 if self.config.async_scheduling and overlap else 0)
        for observer in self.observers:
            outputs = observer.on_step(decision, outputs, started)
        return EngineOutputs(outputs, self.stats())

    def shutdown(self) -> None:
        """Stops what the core started: the tensor-parallel workers."""
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()

    def stats(self) -> EngineStats:
        """The scheduler's, the KV pool's and each observer's statistics, as they stand."""
        allocator, scheduler = self.kv_pool.allocator, self.scheduler
        fields = dict(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_preempted=scheduler.num_preempted,
            num_added=self._num_added,
            kv_usage_ratio=allocator.usage_ratio,
            kv_bytes_used=allocator.num_used * self.kv_pool.shape.bytes_per_block(),
            kv_bytes_total=self.kv_pool.kv_bytes,
            kv_cache_dtype=str(self.kv_pool.shape.dtype).removeprefix("torch."),
            kv_tokens_total=self.kv_pool.num_blocks * self.kv_pool.block_size,
            weights_bytes=self.weights_bytes,
            **self.device_memory.stats(),
        )
        if self.num_speculative_tokens:
            fields.update(scheduler.spec_decode_counts.engine_stats(self.num_speculative_tokens))
        fields.update(scheduler.image_counts.engine_stats())
        for observer in self.observers:
            fields.update(observer.stats())
        return EngineStats(**fields)

    # -- internals --------------------------------------------------------------------------

    def _add(self, engine_request: EngineRequest) -> None:
        """The add path of every request, the shadow check's re-runs included."""
        prompt_ids = list(engine_request.prompt_token_ids)
        request = Request(
            engine_request.request_id,
            prompt_ids,
            engine_request.sampling,
            arrival_index=self._num_added,
            arrival_s=engine_request.arrival_s,
            stop_token_ids=stop_token_ids_of(engine_request.sampling, self.limits.eos_token_ids),
            cache_salt=engine_request.cache_salt,
            # Mean pooling and prompt logprobs read the hidden state of every prompt token, so
            # none may come from the cache (its K/V would, but not its hidden state).
            bypass_prefix_cache=(
                engine_request.bypass_prefix_cache
                or engine_request.sampling.pooling == "mean"
                or engine_request.sampling.prompt_logprobs is not None
            ),
            images=tuple(engine_request.images),
        )
        for observer in self.observers:
            observer.on_add(engine_request)
        try:
            self.limits.check_request(prompt_ids, engine_request.sampling, request.images)
            self.scheduler.add(request)
        except (ValueError, RuntimeError) as error:  # QueueFullError is a RuntimeError
            logger.info("refused request %s: %s", request.request_id, error)
            request.error = f"{type(error).__name__}: {error}"
            self._early_outputs.append(request_output(request, [], FinishReason.ERROR))

    def _idle(self) -> bool:
        return not self.has_work()

    def _collect(self, keep: int) -> list[EngineOutput]:
        """The outputs of the launched steps but the latest `keep`, oldest first."""
        outputs = []
        while len(self._launched) > keep:
            decision = self._launched.popleft()
            try:
                runner_output = self.runner.collect()
            except WorkerDiedError:
                raise
            except Exception as error:  # noqa: BLE001 - as a failed launch
                outputs += self.scheduler.fail(decision, error)
            else:
                outputs += self.scheduler.update(decision, runner_output)
        return outputs
