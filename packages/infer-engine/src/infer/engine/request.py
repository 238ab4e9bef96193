"""One request's life in the engine core.

    WAITING ---admitted---> RUNNING ---last token, or abort---> FINISHED
       |                    |   ^  |
       |         preempted: |   |  +---its forward raised---> FAILED
       |       blocks freed |   | admitted again: recomputes prompt + outputs
       |                    v   |
       |                   PREEMPTED
       +---abort (from WAITING or PREEMPTED)---> FINISHED

A request is `num_computed_tokens` (tokens whose K/V are in its blocks) chasing `num_tokens`
(prompt + every token sampled so far). While prefilling, several known tokens are uncomputed;
while decoding, exactly one: the token it sampled last, fed back in the next step. A step that
computes a request's last known token samples the next one: from the scheduling of that step
until the runner's output arrives, the token is pending (counted in `num_tokens`, its id not yet
in `output_ids`). With async scheduling the next step is scheduled, and can feed the pending
token back, before its id is known. A waiting or
preempted request is FINISHED by an abort too. FINISHED carries a FinishReason: STOP (EOS or a stop
token id), LENGTH (max_new_tokens) or ABORT; FAILED carries the error of the forward that raised.
"""

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer.engine.images import PromptImage, cache_key_ids
from infer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infer.engine.protocol import FinishReason


class QueueFullError(RuntimeError):
    """add_request found max_queue_len requests already waiting (the server answers 503)."""


class RequestTooLongError(ValueError):
    """prompt + max_new_tokens can never fit max_seq_len or the KV pool; the request was not queued."""


class InvalidParamError(ValueError):
    """A request setting the model cannot honour (e.g. a logit_bias id outside its vocabulary);
    `param` names the setting."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Waiting again after a preemption: its blocks were freed, it recomputes when admitted again.
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    """The scheduler owns the counters (its KVCacheManager holds the request's KV blocks, by
    request id); the engine core sets stop_token_ids, and state, finish_reason and error when a
    request ends."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Position in the order of add_request calls: FCFS order, and the seed of unseeded requests.
    arrival_index: int = 0
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens a scheduled step samples whose ids have not come back yet (0 or 1; see the module
    # docstring).
    num_pending_tokens: int = 0
    # Tokens whose K and V are in the request's blocks (0 again after a preemption). While a
    # step verifies draft tokens, they count too, until update() rolls the rejected ones back.
    num_computed_tokens: int = 0
    # Draft tokens a scheduled step verifies, whose verdict has not come back yet.
    num_draft_tokens: int = 0
    # Draft tokens the runner's draft model proposed for the request's next step.
    spec_token_ids: tuple[int, ...] = ()
    # The request's token count when the draft model last drafted for it (0: never, or not since
    # a preemption): the tokens after it are what the draft would catch up on before drafting.
    num_tokens_drafted: int = 0
    num_preemptions: int = 0
    # The step of the latest admission (the first, or the one after a preemption).
    admitted_step: int | None = None
    # The last step that gave this request a token (prefill completion or decode): decode fairness.
    last_served_step: int | None = None
    finish_reason: "FinishReason | None" = None
    error: str | None = None
    # Set by the engine core: the token ids that end this request (its stop_token_ids, and the
    # model's EOS set unless ignore_eos). The request's torch.Generator lives in the runner's
    # InputBatch, made from NewRequest.generator_seed.
    stop_token_ids: frozenset[int] = frozenset()
    # time.monotonic() at add_request (set by the engine core), and at the first step that
    # scheduled the request (set by the scheduler's decision): its queue time.
    arrival_s: float = 0.0
    first_scheduled_s: float | None = None
    # Prefix caching: requests share cached blocks only under the same salt (None is a salt too).
    cache_salt: str | None = None
    # Prompt tokens the first admission took from the prefix cache instead of computing.
    num_cached_tokens: int = 0
    # Computed from scratch and left out of the prefix cache (the engine's shadow re-runs).
    bypass_prefix_cache: bool = False
    # A vision-language model's images, in prompt order (infer.engine.images), and the seconds
    # the vision tower spent on them so far.
    images: tuple[PromptImage, ...] = ()
    vision_encoder_s: float = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def num_tokens(self) -> int:
        """Every token known so far: the prompt, then each sampled token, pending ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, pending ones included: what max_new_tokens bounds."""
        return len(self.output_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """A new list: the prompt, then each sampled token whose id is known."""
        return self.prompt_ids + self.output_ids

    @property
    def cache_key_ids(self) -> list[int]:
        """A new list: what the prefix cache keys the request by, all_token_ids with each image's
        placeholders replaced by its fingerprint's token (infer.engine.images)."""
        return cache_key_ids(self.all_token_ids, self.images) if self.images else self.all_token_ids

    @property
    def is_prefilling(self) -> bool:
        """More than one known token is not computed yet (a prompt, or a recompute after a
        preemption). A decoding request has exactly one: its last sampled token."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.value}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, generated={len(self.output_ids)}, "
            f"pending={self.num_pending_tokens})"
        )
