"""The prefix cache's shadow check (EngineConfig.prefix_cache_shadow_rate): a greedy request
served from the cache is, at that rate, run again without the cache once the engine is idle, and
its tokens compared with the cached run's. A difference is a divergence: the cache served K/V
that recomputing does not give.

The re-run is an `EngineRequest` like any other (the same prompt, salt and sampling parameters,
its grammar included), added through the core's add path with bypass_prefix_cache set; its
outputs answer nobody: this observer takes them out of the step's.
"""

import logging
import random
import time
from collections import deque
from collections.abc import Callable

from infer.engine.decision import ScheduleDecision
from infer.engine.observers import StepObserver
from infer.engine.protocol import EngineOutput, EngineRequest, FinishReason

logger = logging.getLogger(__name__)

SHADOW_ID_PREFIX = "prefix-cache-shadow-"


class PrefixCacheShadow(StepObserver):
    def __init__(
        self, rate: float, seed: int, add: Callable[[EngineRequest], None], idle: Callable[[], bool]
    ):
        """`add`: the core's add path; `idle()`: whether the core has nothing left to step."""
        self.rate = rate
        self.add = add
        self.idle = idle
        self._rng = random.Random(seed)
        # Greedy requests that may be picked, and the tokens each got so far.
        self._candidates: dict[str, tuple[EngineRequest, list[int]]] = {}
        # Re-runs waiting for an idle engine: (the request again, the tokens the cached run gave).
        self._queue: deque[tuple[EngineRequest, list[int]]] = deque()
        # Live re-runs by id: the tokens they must give, and those they gave so far.
        self._shadows: dict[str, tuple[list[int], list[int]]] = {}
        self._num_started = 0
        self.num_runs = 0
        self.num_divergences = 0

    @property
    def pending(self) -> bool:
        """Re-runs are waiting or running."""
        return bool(self._queue or self._shadows)

    def on_add(self, request: EngineRequest) -> None:
        if request.sampling.is_greedy and request.request_id not in self._shadows:
            self._candidates[request.request_id] = (request, [])

    def on_step(
        self, decision: ScheduleDecision, outputs: list[EngineOutput], started_s: float
    ) -> list[EngineOutput]:
        others = []
        for output in outputs:
            shadow = self._shadows.get(output.request_id)
            if shadow is not None:
                shadow[1].extend(output.new_token_ids)
                if output.finished:
                    self._compare(output, *self._shadows.pop(output.request_id))
                continue
            others.append(output)
            candidate = self._candidates.get(output.request_id)
            if candidate is not None:
                candidate[1].extend(output.new_token_ids)
                if output.finished:
                    self._finished(output, *self._candidates.pop(output.request_id))
        if self._queue and not self._shadows and self.idle():
            self._start()
        return others

    def stats(self) -> dict:
        return dict(
            prefix_cache_shadow_runs=self.num_runs, prefix_cache_shadow_divergences=self.num_divergences
        )

    def _finished(self, output: EngineOutput, request: EngineRequest, token_ids: list[int]) -> None:
        """A request served from the cache that ended on a token rule may be picked."""
        if (
            output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            and output.num_cached_tokens
            and self._rng.random() < self.rate
        ):
            self._queue.append((request, token_ids))

    def _start(self) -> None:
        request, expected = self._queue.popleft()
        request_id = f"{SHADOW_ID_PREFIX}{self._num_started}"
        self._num_started += 1
        self._shadows[request_id] = (expected, [])
        self.add(
            EngineRequest(
                request_id,
                request.prompt_token_ids,
                request.sampling,
                arrival_s=time.monotonic(),
                cache_salt=request.cache_salt,
                bypass_prefix_cache=True,
            )
        )

    def _compare(self, output: EngineOutput, expected: list[int], token_ids: list[int]) -> None:
        if output.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return  # refused, failed or aborted: nothing to compare
        self.num_runs += 1
        if token_ids != expected:
            self.num_divergences += 1
            logger.warning(
                "prefix cache divergence: a request served from the cache gave %s, recomputed %s",
                expected,
                token_ids,
            )
