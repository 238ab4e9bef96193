"""Planning one engine step: who is admitted, who prefills how many tokens, who decodes.

Plain data out (`ScheduleDecision`), no tensors, so the scheduler runs in tests against a fake
model (conformance/scheduler/checks.py). The loop, with the engine or a simulation driving:

    scheduler.add(request)                   # rejected at once if it can never fit
    decision = scheduler.schedule()          # admits (reserves KV), plans the step
    ... run decision.prefills and decision.decodes, sample, check stops ...
    scheduler.update(decision, finished=ids) # advance counters, retire and free the finished
    scheduler.remove(request_id)             # abort or failure, at any point between steps

Budgets: at most max_num_seqs requests run at once, at most max_num_batched_tokens tokens per
step (a prefill chunk counts its tokens, a decode counts one), and a KV pool of blocks of
kv_block_size tokens. Admission reserves the blocks for prompt + max_new_tokens in one go (the
slotted pool is one block of max_seq_len per request), so a running request never outgrows the
pool and is never preempted; preemption waits for the paged pool, where blocks grow on demand.

Fairness: a decoding request not served for decode_service_interval steps is served before
anything else in the step (max_num_batched_tokens >= max_num_seqs makes room for all of them),
and admission is strictly first come first served, so a queued request waits only for the
requests ahead of it.
"""

from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from infer.engine.request import QueueFullError, Request, RequestState, RequestTooLongError
from infer.engine.scheduling_policy import ADMIT, policy_named


class BlockPool(Protocol):
    """What the scheduler needs of a KV pool: infer.cache.SlottedKVCache and SlotAllocator fit."""

    @property
    def capacity(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, owner: str) -> int: ...

    def free(self, block: int) -> None: ...


@dataclass(frozen=True)
class PrefillChunk:
    request_id: str
    # Prompt positions [start, start + num_tokens) are computed this step.
    start: int
    num_tokens: int
    # The chunk ends the prompt: the step samples the request's first token from its last position.
    completes_prompt: bool


@dataclass(frozen=True)
class ScheduleDecision:
    step: int
    # Requests that left the queue this step (their KV is reserved), in admission order.
    admitted: tuple[str, ...]
    prefills: tuple[PrefillChunk, ...]
    # Requests that feed back their last token and sample the next one.
    decodes: tuple[str, ...]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefills) + len(self.decodes)

    @property
    def scheduled_request_ids(self) -> tuple[str, ...]:
        return tuple(chunk.request_id for chunk in self.prefills) + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        *,
        kv_pool: BlockPool,
        kv_block_size: int,
        max_seq_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        decode_service_interval: int = 1,
        static_batches: bool = False,
        max_queue_len: int | None = None,
    ):
        for name, value in [
            ("kv_block_size", kv_block_size),
            ("max_seq_len", max_seq_len),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("decode_service_interval", decode_service_interval),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running request can decode in one step"
            )
        self.kv_pool = kv_pool
        self.kv_block_size = kv_block_size
        self.max_seq_len = max_seq_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy_name = policy
        self.policy = policy_named(policy)
        self.decode_service_interval = decode_service_interval
        # Static batching: a new batch is admitted only once the previous one has entirely left.
        self.static_batches = static_batches
        self.max_queue_len = max_queue_len
        self._waiting: deque[Request] = deque()
        # Admission order; the policies rely on it.
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._next_step = 0

    @classmethod
    def from_engine_config(cls, config, *, kv_pool: BlockPool, max_seq_len: int) -> "Scheduler":
        """The engine's scheduler: one KV block is one slot of max_seq_len tokens. max_queue_len is
        left to the engine, which also counts requests added but not yet taken in by a step."""
        return cls(
            kv_pool=kv_pool,
            kv_block_size=max_seq_len,
            max_seq_len=max_seq_len,
            max_num_seqs=config.max_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduler_policy,
            decode_service_interval=config.decode_service_interval,
            static_batches=config.batching_mode == "static",
        )

    # -- queries ----------------------------------------------------------------------------

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv_block_size)

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raises RequestTooLongError when such a request could never run, whatever the load."""
        total = num_prompt_tokens + max_new_tokens
        if total > self.max_seq_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                f"max_seq_len ({self.max_seq_len}); shorten the prompt or lower max_new_tokens"
            )
        blocks = self.blocks_needed(total)
        if blocks > self.kv_pool.capacity:
            raise RequestTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} needs "
                f"{blocks} KV blocks of {self.kv_block_size} tokens but the whole pool has "
                f"{self.kv_pool.capacity}; shorten the request or build a larger pool"
            )

    # -- changes ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queues `request` (state WAITING). Raises RequestTooLongError, QueueFullError or
        ValueError (empty prompt, duplicate id) and then queues nothing."""
        if request.num_prompt_tokens < 1:
            raise ValueError(
                f"request {request.request_id!r} has an empty prompt; it needs at least one token"
            )
        if request.request_id in self._requests:
            raise ValueError(
                f"request id {request.request_id!r} is already queued or running; ids must be unique"
            )
        self.check_fits(request.num_prompt_tokens, request.max_new_tokens)
        if self.max_queue_len is not None and len(self._waiting) >= self.max_queue_len:
            raise QueueFullError(
                f"{len(self._waiting)} requests are waiting, the limit max_queue_len is "
                f"{self.max_queue_len}; retry later"
            )
        request.state = RequestState.WAITING
        self._waiting.append(request)
        self._requests[request.request_id] = request

    def schedule(self) -> ScheduleDecision:
        """Plans the next step: admits from the queue (reserving KV) and splits the token budget."""
        step = self._next_step
        self._next_step += 1
        budget = self.max_num_batched_tokens
        prefills: list[PrefillChunk] = []
        decodes: list[str] = []
        admitted: list[str] = []
        served: set[str] = set()

        def serve(request: Request) -> None:
            nonlocal budget
            if request.request_id in served or budget == 0:
                return
            served.add(request.request_id)
            if request.is_prefilling:
                start = request.num_computed_tokens
                num_tokens = min(request.num_prompt_tokens - start, budget)
                completes = start + num_tokens == request.num_prompt_tokens
                prefills.append(PrefillChunk(request.request_id, start, num_tokens, completes))
                budget -= num_tokens
                if completes:
                    request.last_served_step = step
            else:
                decodes.append(request.request_id)
                budget -= 1
                request.last_served_step = step

        # Static batching opens the door only to a whole new batch.
        may_admit = not (self.static_batches and self._running)
        for request in self._due_decoders(step):
            serve(request)
        for entry in self.policy(tuple(self._running), step):
            if entry is ADMIT:
                if may_admit:
                    self._admit(step, admitted, serve, budget_left=lambda: budget)
            else:
                serve(entry)
        return ScheduleDecision(step, tuple(admitted), tuple(prefills), tuple(decodes))

    def update(self, decision: ScheduleDecision, finished: Iterable[str] = ()) -> None:
        """Records that `decision` ran: prompt chunks and fed-back tokens are now in the KV cache.
        Then retires `finished` (already marked FINISHED or FAILED by the caller): their blocks are
        free before the next schedule()."""
        for chunk in decision.prefills:
            request = self._requests.get(chunk.request_id)
            if request is not None:
                request.num_computed_tokens += chunk.num_tokens
                if chunk.completes_prompt and request.state is RequestState.PREFILL:
                    request.state = RequestState.DECODE
        for request_id in decision.decodes:
            request = self._requests.get(request_id)
            if request is not None:
                request.num_computed_tokens += 1
        for request_id in finished:
            self.remove(request_id)

    def remove(self, request_id: str) -> Request | None:
        """Takes a request out, queued or running, and frees its KV blocks (abort, failure, finish).
        Returns it, or None when it is unknown or already gone."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request in self._waiting:
            self._waiting.remove(request)
        else:
            self._running.remove(request)
        for block in request.kv_blocks:
            self.kv_pool.free(block)
        request.kv_blocks = []
        return request

    def leaked_blocks(self, live_owners: Collection[str] | None = None) -> list[int]:
        """Blocks the pool lends to requests this scheduler no longer runs (should be empty)."""
        audit = getattr(self.kv_pool, "audit", None)
        if audit is None:
            return []
        return audit(self._requests.keys() if live_owners is None else live_owners)

    # -- internals --------------------------------------------------------------------------

    def _due_decoders(self, step: int) -> list[Request]:
        """Decoding requests whose last token is decode_service_interval steps old, most overdue first."""
        due = [
            request
            for request in self._running
            if not request.is_prefilling
            and request.last_served_step is not None
            and step - request.last_served_step >= self.decode_service_interval
        ]
        return sorted(due, key=lambda request: request.last_served_step)

    def _admit(self, step: int, admitted: list[str], serve, budget_left) -> None:
        # Strict FCFS: when the head of the queue does not fit, nobody behind it is considered.
        while self._waiting and len(self._running) < self.max_num_seqs:
            # Continuous batching admits only requests that start prefilling this step; a static
            # batch is admitted whole and prefills over as many steps as the budget needs.
            if not self.static_batches and budget_left() == 0:
                return
            request = self._waiting[0]
            num_blocks = self.blocks_needed(request.max_total_tokens)
            if self.kv_pool.num_free < num_blocks:
                return
            self._waiting.popleft()
            request.kv_blocks = [self.kv_pool.allocate(request.request_id) for _ in range(num_blocks)]
            request.state = RequestState.PREFILL
            request.admitted_step = step
            self._running.append(request)
            admitted.append(request.request_id)
            serve(request)
