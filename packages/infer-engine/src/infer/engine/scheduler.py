"""Planning one engine step: how many tokens each request runs, who is admitted, who is preempted.

Plain data out (`infer.engine.decision.ScheduleDecision`), no tensors, so the scheduler runs in
tests against a fake runner (conformance/scheduler/checks.py). A request is
`num_computed_tokens` chasing `num_tokens` (prompt + sampled tokens); the scheduler only ever
decides "run n more tokens of this request", and it alone moves num_computed_tokens (the
KVCacheManager holds the request's blocks and says what its calls reused or freed). The loop,
with the engine or a simulation driving:

    scheduler.add(request)                    # rejected at once if it can never fit
    decision = scheduler.schedule()           # admits, takes blocks, preempts, plans the step
    runner_output = runner.execute(decision)  # one forward; a token for each row that reached
                                              # its last known token
    outputs = scheduler.update(decision, runner_output)
                                              # the token rules (EOS, stop ids, max tokens) and
                                              # the grammars: who ends is finished, blocks freed

`update` is vLLM's `update_from_output`: it applies the core's token rules
(`infer.engine.stop.token_finish_reason`) and moves each constrained request's grammar matcher
(`StructuredOutput`, which the scheduler holds) past its tokens, finishes whatever ended and
returns the step's `EngineOutput`s. `abort` and `fail` end requests outside a step's tokens.

schedule() counts the step as run: the scheduled tokens are computed, and a request whose step
reaches its last known token gains a pending token (Request.num_pending_tokens), which update()
replaces with the sampled id. So the next schedule() may come before the previous update() (async
scheduling): a request then decodes its pending token, whose id only the runner's device holds;
one that may generate no more (max_new_tokens) is not scheduled; one that stops on its pending
token is finished by update() after that next step ran, whose token for it is then dropped.

Budgets: at most max_batch_size requests run at once, at most max_num_batched_tokens tokens per
step (a prefill chunk counts its tokens, a decode counts one), and the KV pool behind
`kv_manager`. Blocks are taken as tokens are scheduled (`kv_manager.allocate(request, n)`), never
for prompt + max_new_tokens up front.

Prefill: with use_chunked_prefill, a request's prompt (or recompute) goes in chunks of at most
prefill_chunk_size tokens and at most the step's remaining budget, and a step holds at most
max_prefill_chunks_per_step prefill rows (None: no cap). Without it, a prompt is scheduled whole
in one step and waits for a step whose remaining budget holds it, with one exception: a prompt
longer than max_num_batched_tokens, which no budget ever holds, runs whole in a step with no
other prefill (that step then exceeds max_num_batched_tokens by the prompt's excess).

Images (vision-language models): with `whole_images` (a model whose image tokens attend to each
other both ways, as Gemma 3's), a prompt chunk never ends inside an image: it stops before the
image, or, starting at or inside it, runs through the image's last token or waits for a step
whose budget holds that (an image's tokens must be computed in one forward to see each other).
Without it a chunk may end anywhere. `ImageCounts` counts what the vision tower had to encode and
what the prefix cache spared it.

Preemption (recompute): when a running request cannot get the blocks for its tokens, the
lowest-priority running request is preempted: the most recently admitted one not already
scheduled in this step (the requester itself when it is that one). Its blocks are all freed,
num_computed_tokens drops to 0 (a pending token stays pending: update() adds it to the
waiting request, which is admitted again only once no token is pending), it waits again (state
PREEMPTED) ahead of every request that never ran, and the decision lists it in
`preempted_request_ids`; then the allocation is retried.
Admitted again, it goes out as a NewRequest with every token it knows (prompt + outputs) and
recomputes them; the runner samples its next token once its last known token is computed, so
greedy output is the same as if it had never been preempted. A step that preempts admits no one.

Speculative decoding (infer.engine.spec_decode): a request about to decode its last token may
run 1 + K tokens, its last token and K drafts (decision.spec_token_ids), from the n-gram
proposer here or from the draft model the runner ran after the request's last step
(RunnerOutput.spec_token_ids), as many as the step's budget and max_new_tokens allow, and only
where their blocks are free (speculation never preempts). Drafts count as computed; update()
takes the 1..K + 1 tokens the runner kept and rolls num_computed_tokens back over the rejected
drafts, whose blocks stay the request's. With a draft model, every step that samples holds
blocks for K positions of lookahead, where the draft writes its drafts' K/V. Steps speculate
only while the share of drafts kept holds up (spec_decode.backoff) and, with
disable_by_batch_size, while few enough requests run.

Fairness: a decoding request not served for decode_service_interval steps is served before
anything else in the step (max_num_batched_tokens >= max_batch_size makes room for all of them),
and admission is strictly first come first served, so a queued request waits only for the
requests ahead of it. The policy (scheduling_policy.py) orders the rest of the step.
"""

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from infer.engine.decision import NewRequest, PromptLogprobs, RunnerOutput, RunningRequest, ScheduleDecision
from infer.engine.images import ImageCounts
from infer.engine.kv_manager import KVCacheManager
from infer.engine.protocol import EngineOutput, FinishReason, TokenLogprobs, check_fits
from infer.engine.request import QueueFullError, Request, RequestState
from infer.engine.scheduling_policy import ADMIT, policy_named
from infer.engine.spec_decode import NgramProposer, SpecDecodeCounts, SpeculationBackoff, proposer_for
from infer.engine.stop import token_finish_reason

if TYPE_CHECKING:
    from infer.engine.sampler import AllowedTokens
    from infer.engine.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


@dataclass
class _StepPlan:
    """What one schedule() call has decided so far."""

    step: int
    budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    num_prefill_rows: int = 0
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_running_at_start: int = 0  # for disable_speculation_above

    def add(
        self, request: Request, num_tokens: int, new_block_ids: list[int], drafts: tuple[int, ...] = ()
    ) -> None:
        if request.is_prefilling:
            self.num_prefill_rows += 1
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = new_block_ids
        if drafts:
            self.spec_token_ids[request.request_id] = drafts
        # Below 0 only after a whole prompt longer than the budget (see the module docstring).
        self.budget = max(0, self.budget - num_tokens)
        if request.num_computed_tokens + num_tokens - len(drafts) == request.num_tokens:
            request.last_served_step = self.step


class Scheduler:
    def __init__(
        self,
        *,
        kv_manager: KVCacheManager,
        max_seq_len: int,
        max_batch_size: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        decode_service_interval: int = 1,
        static_batches: bool = False,
        use_chunked_prefill: bool = False,
        prefill_chunk_size: int = 512,
        max_prefill_chunks_per_step: int | None = None,
        max_queue_len: int | None = None,
        engine_seed: int = 0,
        structured_output: "StructuredOutput | None" = None,
        proposer: "NgramProposer | None" = None,
        disable_speculation_above: int | None = None,
        speculation_backoff: SpeculationBackoff | None = None,
        num_lookahead_tokens: int = 0,
        whole_images: bool = False,
    ):
        """`structured_output`: the grammar matchers of constrained requests; None refuses a
        request with a grammar. `proposer`: drafts for decoding requests (speculative decoding;
        None: none), in steps that start with at most `disable_speculation_above` running
        requests (None: any) and that `speculation_backoff` lets speculate (None: every such
        step). `num_lookahead_tokens`: blocks for this many positions past a
        request's step wherever the step samples (a draft model writes its drafts' K/V there);
        drafts then come from the runner (RunnerOutput.spec_token_ids) when `proposer` is None.
        `whole_images`: no prompt chunk ends inside an image (see the module docstring)."""
        for name, value in [
            ("max_seq_len", max_seq_len),
            ("max_batch_size", max_batch_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("decode_service_interval", decode_service_interval),
            ("prefill_chunk_size", prefill_chunk_size),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_prefill_chunks_per_step is not None and max_prefill_chunks_per_step < 1:
            raise ValueError(
                f"max_prefill_chunks_per_step must be >= 1 or None, got {max_prefill_chunks_per_step}"
            )
        if max_num_batched_tokens < max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_batch_size "
                f"({max_batch_size}) so that every running request can decode in one step"
            )
        self.kv_manager = kv_manager
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy_name = policy
        self.policy = policy_named(policy)
        self.decode_service_interval = decode_service_interval
        # Static batching: a new batch is admitted only once the previous one has entirely left.
        self.static_batches = static_batches
        self.use_chunked_prefill = use_chunked_prefill
        self.prefill_chunk_size = prefill_chunk_size
        self.max_prefill_chunks_per_step = max_prefill_chunks_per_step
        self.max_queue_len = max_queue_len
        self.engine_seed = engine_seed
        self.structured_output = structured_output
        self.proposer = proposer
        self.disable_speculation_above = disable_speculation_above
        self.speculation_backoff = speculation_backoff
        self.num_lookahead_tokens = num_lookahead_tokens
        self.whole_images = whole_images
        self.spec_decode_counts = SpecDecodeCounts()
        self.image_counts = ImageCounts()
        self.num_preempted = 0
        # Preempted requests first (in admission order), then those that never ran (in arrival order).
        self._waiting: deque[Request] = deque()
        # Admission order (a re-admission counts as the latest); preemption picks from the end.
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Position of each running or preempted request's latest admission.
        self._admission_order: dict[str, int] = {}
        self._num_admissions = 0
        # Requests the runner holds a row for: sent as NewRequest, not preempted or finished since.
        self._in_runner: set[str] = set()
        # Left since the previous decision, with a row in the runner: the next decision says so.
        self._finished_ids: set[str] = set()
        self._next_step = 0

    @classmethod
    def from_engine_config(
        cls,
        config,
        *,
        kv_manager: KVCacheManager,
        max_seq_len: int,
        structured_output: "StructuredOutput | None" = None,
        whole_images: bool = False,
    ) -> "Scheduler":
        """The engine's scheduler. max_queue_len is left to the engine, which also counts requests
        added but not yet taken in by a step."""
        return cls(
            kv_manager=kv_manager,
            max_seq_len=max_seq_len,
            max_batch_size=config.max_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduler_policy,
            decode_service_interval=config.decode_service_interval,
            static_batches=config.batching_mode == "static",
            use_chunked_prefill=config.use_chunked_prefill,
            prefill_chunk_size=config.prefill_chunk_size,
            max_prefill_chunks_per_step=config.max_prefill_chunks_per_step,
            engine_seed=config.seed,
            structured_output=structured_output,
            proposer=proposer_for(config.speculative),
            disable_speculation_above=(
                config.speculative.disable_by_batch_size if config.speculative is not None else None
            ),
            speculation_backoff=(
                SpeculationBackoff(config.speculative.min_acceptance_rate)
                if config.speculative is not None
                else None
            ),
            num_lookahead_tokens=(
                config.speculative.num_speculative_tokens
                if config.speculative is not None and config.speculative.method == "draft_model"
                else 0
            ),
            whole_images=whole_images,
        )

    # -- queries ----------------------------------------------------------------------------

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting requests in the order they will be admitted (preempted ones first)."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """Running requests in admission order."""
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

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raises RequestTooLongError when such a request could never run, whatever the load."""
        kv = self.kv_manager
        check_fits(num_prompt_tokens, max_new_tokens, self.max_seq_len, kv.block_size, kv.num_blocks)

    # -- changes ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queues `request` (state WAITING), with its grammar's matcher when it has one. Raises
        RequestTooLongError, QueueFullError or ValueError (empty prompt, duplicate id, a grammar
        that cannot be enforced) and then queues nothing."""
        if request.num_prompt_tokens < 1:
            raise ValueError(
                f"request {request.request_id!r} has an empty prompt; it needs at least one token"
            )
        if request.request_id in self._requests:
            raise ValueError(
                f"request id {request.request_id!r} is already queued or running; ids must be unique"
            )
        self.check_fits(request.num_prompt_tokens, request.max_new_tokens)
        self._check_images(request)
        if self.max_queue_len is not None and len(self._waiting) >= self.max_queue_len:
            raise QueueFullError(
                f"{len(self._waiting)} requests are waiting, the limit max_queue_len is "
                f"{self.max_queue_len}; retry later"
            )
        grammar = request.params.grammar
        if grammar is not None:
            if self.structured_output is None:
                raise ValueError(f"request {request.request_id!r} has a grammar; this scheduler has none")
            self.structured_output.add(request.request_id, self.structured_output.matcher(grammar))
        request.state = RequestState.WAITING
        self._waiting.append(request)
        self._requests[request.request_id] = request

    def _check_images(self, request: Request) -> None:
        """With whole_images, raises ValueError for an image longer than a step's token budget (it
        could never run). Where images lie is CoreLimits.check_request's to check."""
        for index, image in enumerate(request.images if self.whole_images else ()):
            if image.num_tokens > self.max_num_batched_tokens:
                raise ValueError(
                    f"request {request.request_id!r}: image {index} takes {image.num_tokens} tokens, "
                    f"more than max_num_batched_tokens ({self.max_num_batched_tokens}) holds in a step"
                )

    def schedule(self) -> ScheduleDecision:
        """Plans the next step: serves due decoders, then the policy's order (running requests and
        admission from the queue), taking blocks as it goes and preempting when they run out."""
        plan = _StepPlan(
            step=self._next_step, budget=self.max_num_batched_tokens, num_running_at_start=len(self._running)
        )
        self._next_step += 1
        # Static batching opens the door only to a whole new batch.
        may_admit = not (self.static_batches and self._running)
        for request in self._due_decoders(plan.step):
            self._serve(request, plan)
        for entry in self.policy(tuple(self._running), plan.step):
            if entry is ADMIT:
                # Re-admitting in the step that preempted would only undo the preemption.
                if may_admit and not plan.preempted:
                    self._admit(plan)
            else:
                self._serve(entry, plan)
        decision = self._decision(plan)
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self._requests[request_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens - num_tokens < request.num_prompt_tokens:
                self.kv_manager.cache_computed(request)  # a prompt chunk: share it at once
            # Draft tokens count as computed until update() rolls the rejected ones back.
            request.num_draft_tokens = len(plan.spec_token_ids.get(request_id, ()))
            if request.num_computed_tokens - request.num_draft_tokens == request.num_tokens:
                request.num_pending_tokens += 1  # this step samples its next token
        return decision

    def update(self, decision: ScheduleDecision, runner_output: RunnerOutput) -> list[EngineOutput]:
        """Takes what `decision`'s step sampled: each token replaces a pending token of its
        request and joins its output_ids; the token rules and the request's grammar decide
        whether it ends on one of them (what follows is dropped), and a request that ends is
        finished. Returns an EngineOutput for each request that got a token, in decision order.
        Requests finished since the decision are skipped (their tokens are dropped).

        After a failed forward, call fail() instead."""
        sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True))
        self.kv_manager.store_transfer_s += runner_output.store_transfer_s
        for request_id, (num_images, seconds) in runner_output.images_encoded.items():
            self.image_counts.num_encoded += num_images
            self.image_counts.encoder_s += seconds
            if (request := self._requests.get(request_id)) is not None:
                request.vision_encoder_s += seconds
        outputs: list[EngineOutput] = []
        step_drafts = step_accepted = 0
        for request_id in decision.num_scheduled_tokens:
            if (request := self._requests.get(request_id)) is None:
                continue  # finished since
            # Drafts for this request's next step, or none: older ones are for other positions.
            request.spec_token_ids = runner_output.spec_token_ids.get(request_id, ())
            new_token_ids = list(sampled.get(request_id, ()))
            if not new_token_ids:
                continue  # nothing sampled
            num_drafts = request.num_draft_tokens
            if len(new_token_ids) > request.num_pending_tokens + num_drafts:
                raise ValueError(
                    f"the runner sampled {new_token_ids} for {request_id!r}, which has "
                    f"{request.num_pending_tokens} pending tokens and {num_drafts} draft tokens; a "
                    "row samples only once its last known token is computed"
                )
            if num_drafts:
                # The accepted drafts and the target's token: the rejected drafts' K/V is no
                # longer computed. Their blocks stay the request's (the runner's block table holds
                # them, and the request grows into them next), so none is lost or lent twice.
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= num_drafts - num_accepted
                request.num_draft_tokens = 0
                request.num_pending_tokens -= 1
                self.spec_decode_counts.record(num_drafts, num_accepted)
                step_drafts, step_accepted = step_drafts + num_drafts, step_accepted + num_accepted
            else:
                request.num_pending_tokens -= len(new_token_ids)
            request.output_ids.extend(new_token_ids)
            if request_id in runner_output.spec_token_ids:
                request.num_tokens_drafted = request.num_tokens
            outputs.append(
                self._accept(
                    request,
                    new_token_ids,
                    runner_output.logprobs.get(request_id),
                    embedding=runner_output.pooled.get(request_id),
                    prompt_logprobs=runner_output.prompt_logprobs.get(request_id),
                )
            )
        if self.speculation_backoff is not None:
            self.speculation_backoff.record(step_drafts, step_accepted)
        return outputs

    def abort(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        """Ends these requests now (blocks freed at once): a final output (FinishReason.ABORT)
        for each. Ids unknown or finished are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.finish(request_id)
            if request is not None:
                request.state = RequestState.FINISHED
                request.finish_reason = FinishReason.ABORT
                outputs.append(request_output(request, [], FinishReason.ABORT))
        return outputs

    def fail(self, decision: ScheduleDecision, error: Exception) -> list[EngineOutput]:
        """Fails the decision's requests that are still here: its forward raised `error`. Their
        K/V may be wrong: none of it goes to the prefix cache."""
        requests = [
            request for request_id in decision.scheduled_request_ids if (request := self.get(request_id))
        ]
        logger.exception("forward failed for %s", [request.request_id for request in requests])
        message = f"{type(error).__name__}: {error}"
        outputs = []
        for request in requests:
            request.state = RequestState.FAILED
            request.error = message
            self.finish(request.request_id, cache=False)
            outputs.append(request_output(request, [], FinishReason.ERROR))
        return outputs

    def constrains_any(self, decision: ScheduleDecision) -> bool:
        """Whether a request of the decision samples under a grammar."""
        grammars = self.structured_output
        return bool(grammars) and grammars.constrains_any(decision.num_scheduled_tokens)

    def grammar_masks(
        self, sampling_ids: Sequence[str], drafts: Sequence[Sequence[int]] = ()
    ) -> "AllowedTokens | None":
        """The allowed tokens of the constrained requests among a step's sampling rows (row i:
        sampling_ids[i]; with `drafts`, request i's len(drafts[i]) + 1 verified positions), from
        their matchers as they stand; None when none is constrained."""
        if not self.structured_output:
            return None
        return self.structured_output.allowed(sampling_ids, drafts)

    def finish(self, request_id: str, *, cache: bool = True) -> Request | None:
        """Takes a request out, waiting or running, and frees its blocks (it finished, was aborted
        or failed; the caller sets its state and finish_reason), its computed tokens going to the
        prefix cache unless `cache` is False (a failed forward). The next decision lists it in
        finished_request_ids if the runner holds its row. Returns it, or None when it is unknown
        or already gone."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if self.structured_output is not None:
            self.structured_output.remove(request_id)
        if request in self._running:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.kv_manager.free(request, cache=cache)
        self._admission_order.pop(request_id, None)
        if request_id in self._in_runner:
            self._in_runner.remove(request_id)
            self._finished_ids.add(request_id)
        return request

    # -- internals --------------------------------------------------------------------------

    def _accept(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: Sequence[TokenLogprobs] | None,
        *,
        embedding: np.ndarray | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> EngineOutput:
        """`token_ids` are already in request.output_ids: the token rules decide whether the
        request ends on one of them, its grammar whether it takes them; one that ends is finished."""
        first = len(request.output_ids) - len(token_ids)
        accepted: list[int] = []
        reason = None
        for index, token_id in enumerate(token_ids):
            accepted.append(token_id)
            reason = token_finish_reason(request.params, request.stop_token_ids, first + index + 1, token_id)
            if reason is not None:
                break
        refused = (
            self.structured_output.advance(request.request_id, accepted) if self.structured_output else None
        )
        if refused is not None:  # the mask allowed it: a bug, never the client's doing
            token_id = accepted[refused]
            logger.error("request %s: its grammar refused token %d", request.request_id, token_id)
            request.state = RequestState.FAILED
            request.error = f"GrammarError: the grammar refused sampled token {token_id}"
            reason = FinishReason.ERROR
            accepted = accepted[:refused]
        if reason is FinishReason.ERROR:
            # What a failure computed may be wrong: none of it goes to the prefix cache.
            self.finish(request.request_id, cache=False)
        elif reason is not None:
            request.state = RequestState.FINISHED
            request.finish_reason = reason
            self.finish(request.request_id)
        accepted_logprobs = list(logprobs[: len(accepted)]) if logprobs is not None else None
        return request_output(
            request,
            accepted,
            reason,
            first_token=first == 0,
            logprobs=accepted_logprobs,
            embedding=embedding,
            # Only with the first token: a request resumed after a preemption does not repeat them.
            prompt_logprobs=prompt_logprobs if first == 0 else None,
        )

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

    def _num_tokens_to_schedule(self, request: Request, plan: _StepPlan) -> int:
        """How many of the request's uncomputed tokens this step can take (0: none, it waits)."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not request.is_prefilling:
            # Its pending token may be its last; the stop check ends it once the id is known.
            if request.num_output_tokens >= request.max_new_tokens:
                return 0
            return min(remaining, plan.budget)
        if self.use_chunked_prefill:
            cap = self.max_prefill_chunks_per_step
            if cap is not None and plan.num_prefill_rows >= cap:
                return 0
            num_tokens = min(remaining, self.prefill_chunk_size, plan.budget)
            return self._whole_images(request, num_tokens, plan) if self.whole_images else num_tokens
        if remaining <= plan.budget:
            return remaining
        # A prompt no budget can hold runs whole in a step with no other prefill.
        if remaining > self.max_num_batched_tokens and plan.num_prefill_rows == 0:
            return remaining
        return 0

    def _whole_images(self, request: Request, num_tokens: int, plan: _StepPlan) -> int:
        """`num_tokens` of the request's chunk, cut so that it does not end inside an image."""
        start = request.num_computed_tokens
        end = start + num_tokens
        for image in request.images:
            if image.offset < end < image.end:
                if image.offset > start:
                    return image.offset - start  # up to the image; it goes whole in a later chunk
                through_image = image.end - start
                return through_image if through_image <= plan.budget else 0
        return num_tokens

    def _serve(self, request: Request, plan: _StepPlan) -> None:
        """Schedules the running request's next tokens if the budget allows, preempting others
        (or itself) when the blocks for them are missing."""
        # Already served, or preempted earlier in this step.
        if request.request_id in plan.num_scheduled_tokens or request.state is not RequestState.RUNNING:
            return
        num_tokens = self._num_tokens_to_schedule(request, plan)
        if num_tokens == 0:
            return
        drafts = self._drafts(request, plan) if num_tokens == 1 else ()
        # Drafts only where their blocks are free: speculation never preempts anyone.
        if drafts:
            with_drafts = 1 + len(drafts)
            lookahead = self._lookahead(request, with_drafts, len(drafts))
            if (new_block_ids := self.kv_manager.allocate(request, with_drafts, lookahead)) is not None:
                plan.add(request, with_drafts, new_block_ids, drafts)
                return
        lookahead = self._lookahead(request, num_tokens)
        while (new_block_ids := self.kv_manager.allocate(request, num_tokens, lookahead)) is None:
            victim = self._preemption_victim(request, plan)
            if victim is None:
                return
            self._preempt(victim, plan)
            if victim is request:
                return
        plan.add(request, num_tokens, new_block_ids)

    def _lookahead(self, request: Request, num_tokens: int, num_drafts: int = 0) -> int:
        """Positions past the step (its `num_tokens`, `num_drafts` of them drafts) to hold blocks
        for: the draft model's, where the step samples, up to the last position a sequence may
        have."""
        if not self.num_lookahead_tokens:
            return 0
        end = request.num_computed_tokens + num_tokens
        if end - num_drafts != request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_seq_len - end))

    def _drafts(self, request: Request, plan: _StepPlan) -> tuple[int, ...]:
        """The proposer's draft tokens for a request about to decode its last token: as many as
        the step's budget and the request's max_new_tokens allow, and, for a request with a
        grammar, as its matcher allows (the target's mask still applies at every position)."""
        if (self.proposer is None and not request.spec_token_ids) or request.num_pending_tokens:
            return ()
        limit = self._speculating_rows(plan.step, plan.num_running_at_start)
        if limit is not None and len(plan.spec_token_ids) >= limit:
            return ()
        # The step emits up to K + 1 tokens, all within max_new_tokens.
        room = min(plan.budget - 1, request.max_new_tokens - request.num_output_tokens - 1)
        if room < 1:
            return ()
        if self.proposer is not None:
            # Images' placeholders read as their fingerprints' negative tokens: a lookup never
            # matches one image's run against another's, and never drafts a placeholder.
            history = request.cache_key_ids if request.images else request.all_token_ids
            drafts = self.proposer.propose(np.asarray(history, dtype=np.int64))
        else:  # the runner's draft model proposed them after the request's last step
            drafts, request.spec_token_ids = request.spec_token_ids, ()
        drafts = tuple(int(token) for token in drafts[:room])
        if any(token < 0 for token in drafts):
            drafts = drafts[: next(i for i, token in enumerate(drafts) if token < 0)]
        if drafts and request.params.grammar is not None:
            drafts = self.structured_output.valid_drafts(request.request_id, drafts)
        return drafts

    def _speculating_rows(self, step: int, num_running: int) -> int | None:
        """How many requests may verify drafts in step number `step`, which starts with
        `num_running` running requests: None for every one."""
        above = self.disable_speculation_above
        if above is not None and num_running > above:
            return 0
        return None if self.speculation_backoff is None else self.speculation_backoff.rows(step)

    def _preemption_victim(self, request: Request, plan: _StepPlan) -> Request | None:
        """The most recently admitted running request that holds blocks and is not scheduled in
        this step; `request` itself when none is more recent than it. None when `request` holds no
        blocks either (a static batch member not started yet): it just waits."""
        block_ids = self.kv_manager.block_ids
        for candidate in reversed(self._running):
            if candidate is request:
                return request if block_ids(request.request_id) else None
            if block_ids(candidate.request_id) and candidate.request_id not in plan.num_scheduled_tokens:
                return candidate
        raise AssertionError(f"{request.request_id!r} is served but not running")

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.num_tokens_drafted = 0  # the draft model forgets it too
        request.state = RequestState.PREEMPTED
        request.num_preemptions += 1
        self.num_preempted += 1
        self._running.remove(request)
        self._in_runner.discard(request.request_id)
        plan.preempted.append(request.request_id)
        # Ahead of every request that never ran; behind preempted ones admitted before it.
        order = self._admission_order[request.request_id]
        position = next(
            (
                index
                for index, waiting in enumerate(self._waiting)
                if waiting.state is not RequestState.PREEMPTED
                or self._admission_order[waiting.request_id] > order
            ),
            len(self._waiting),
        )
        self._waiting.insert(position, request)

    def _admit(self, plan: _StepPlan) -> None:
        # Strict FCFS: when the head of the queue cannot start, nobody behind it is considered.
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting[0]
            if request.num_pending_tokens:
                return  # preempted with a token on its way (async scheduling): resumed with it
            # What the prefix cache holds of its tokens counts as computed (undone if it waits).
            num_reused = self.kv_manager.acquire(request, self.kv_manager.match(request))
            if num_reused is None:
                return  # its stored blocks wait for free ones to come back to
            self._count_reused(request, num_reused)
            num_tokens = self._num_tokens_to_schedule(request, plan)
            # Continuous batching admits only requests that start this step; a static batch is
            # admitted whole and its members start as the budget allows.
            if num_tokens == 0 and not self.static_batches:
                self._release(request)
                return
            new_block_ids: list[int] = []
            if num_tokens > 0:
                # Leave the blocks that running requests still to be served this step need for
                # their next token: admission should not cause a preemption.
                lookahead = self._lookahead(request, num_tokens)
                num_blocks = self.kv_manager.num_new_blocks(request, num_tokens, lookahead)
                if num_blocks + self._blocks_for_unserved_decoders(plan) > self.kv_manager.num_free_blocks:
                    self._release(request)
                    return
                new_block_ids = self.kv_manager.allocate(request, num_tokens, lookahead)
            self._waiting.popleft()
            if request.images:
                self.image_counts.admitted(request.images, request.num_computed_tokens)
            request.state = RequestState.RUNNING
            request.admitted_step = plan.step
            self._admission_order[request.request_id] = self._num_admissions
            self._num_admissions += 1
            self._running.append(request)
            if num_tokens > 0:
                plan.add(request, num_tokens, new_block_ids)

    def _count_reused(self, request: Request, num_reused: int) -> None:
        """The `num_reused` tokens a waiting request took from the prefix cache count as computed."""
        request.num_computed_tokens = num_reused
        if num_reused and not request.num_preemptions:
            # What usage reports: prompt tokens of its first admission (a resumed request also
            # reuses its own outputs, and its prompt was answered for already).
            request.num_cached_tokens = min(num_reused, request.num_prompt_tokens)

    def _release(self, request: Request) -> None:
        """Undoes `_count_reused` and the acquire behind it: the request waits, nothing computed."""
        self.kv_manager.release(request)
        request.num_computed_tokens = 0
        if not request.num_preemptions:
            request.num_cached_tokens = 0

    def _blocks_for_unserved_decoders(self, plan: _StepPlan) -> int:
        return sum(
            self.kv_manager.num_new_blocks(request, 1)
            for request in self._running
            if request.request_id not in plan.num_scheduled_tokens and not request.is_prefilling
        )

    def _decision(self, plan: _StepPlan) -> ScheduleDecision:
        new_requests: list[NewRequest] = []
        running_requests: list[RunningRequest] = []
        num_prompt_tokens = 0
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self._requests[request_id]
            # All but decodes of a sampled token: a new or resumed request computes prompt or
            # recompute work (num_computed_tokens is the count before this step).
            is_decode = (
                num_tokens - len(plan.spec_token_ids.get(request_id, ())) == 1
                and request_id in self._in_runner
                and request.num_computed_tokens >= request.num_prompt_tokens
            )
            num_prompt_tokens += 0 if is_decode else num_tokens
            if request_id in self._in_runner:
                running_requests.append(
                    RunningRequest(
                        request_id=request_id,
                        new_block_ids=tuple(plan.new_block_ids[request_id]),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                if request.first_scheduled_s is None:  # its queue time ends (not a resumed request)
                    request.first_scheduled_s = time.monotonic()
                new_requests.append(
                    NewRequest(
                        request_id=request_id,
                        token_ids=tuple(request.all_token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling=request.params,
                        generator_seed=self._generator_seed(request),
                        block_ids=self.kv_manager.block_ids(request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        images=request.images,
                    )
                )
                self._in_runner.add(request_id)
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return ScheduleDecision(
            step=plan.step,
            new_requests=tuple(new_requests),
            running_requests=tuple(running_requests),
            num_scheduled_tokens=dict(plan.num_scheduled_tokens),
            finished_request_ids=finished,
            preempted_request_ids=frozenset(plan.preempted),
            block_ops=self.kv_manager.take_block_ops(),
            num_prompt_tokens=num_prompt_tokens,
            spec_token_ids=dict(plan.spec_token_ids),
            draft_request_ids=self._draft_request_ids(plan),
        )

    def speculates_after(self, decision: ScheduleDecision) -> bool:
        """Whether `decision` verifies drafts or the step after it may: then the engine reads
        its tokens before it plans the next step (no async overlap), since a verdict decides how
        many tokens each request has and the next step's drafts continue them."""
        if self.speculation_backoff is None:
            return False
        return bool(decision.spec_token_ids) or decision.draft_request_ids != frozenset()

    def _draft_request_ids(self, plan: _StepPlan) -> frozenset[str] | None:
        """The requests a draft model drafts for after the step of `plan`, ahead of the next: as
        many as may verify drafts then (None: every one). When fewer, those the step samples for
        with the fewest tokens the draft has not seen, since a probe's cost is mostly the draft's
        catch-up forward over them: a request it drafted for lately, or a short one."""
        limit = self._speculating_rows(plan.step + 1, len(self._running))
        if limit is None:
            return None
        if limit == 0:  # most steps of a backed-off engine: no scan of the running requests
            return frozenset()
        sampling = [
            request
            for request in self._running
            if request.request_id in plan.num_scheduled_tokens
            and request.num_computed_tokens
            + plan.num_scheduled_tokens[request.request_id]
            - len(plan.spec_token_ids.get(request.request_id, ()))
            >= request.num_tokens
        ]
        sampling.sort(key=lambda request: request.num_tokens - request.num_tokens_drafted)
        return frozenset(request.request_id for request in sampling[:limit])

    def _generator_seed(self, request: Request) -> int:
        # A request without its own seed draws from one derived from the engine seed and its
        # arrival, so the same seed and the same queue give the same tokens.
        if request.params.seed is not None:
            return request.params.seed
        return (self.engine_seed * 1_000_003 + request.arrival_index) % 2**63


def request_output(
    request: Request,
    token_ids: list[int],
    finish_reason: FinishReason | None,
    *,
    first_token: bool = False,
    logprobs: list[TokenLogprobs] | None = None,
    embedding: np.ndarray | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
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
        # Every image is encoded before the prompt's last token, so by the first token.
        vision_encoder_s=request.vision_encoder_s if first_token and token_ids and request.images else None,
        embedding=embedding,
        prompt_logprobs=prompt_logprobs,
    )
