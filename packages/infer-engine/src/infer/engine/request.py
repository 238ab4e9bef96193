"""One request's life in the engine, and what each step reports about it.

    WAITING --admitted--> PREFILL --prompt in cache, first token--> DECODE --> FINISHED
       \\____________________\\_____________________________________\\____--> FAILED (error)

A request is FINISHED with finish_reason "stop" (EOS, a stop token id, a stop string),
"length" (max_new_tokens) or "abort"; FAILED when the forward of its batch raised.
"""

import enum
from dataclasses import dataclass, field
from typing import Any

from infer.engine.sampling_params import SamplingParams

FINISH_ABORT = "abort"


class QueueFullError(RuntimeError):
    """add_request found max_queue_len requests already waiting (the server answers 503)."""


class RequestTooLongError(ValueError):
    """prompt + max_new_tokens can never fit max_seq_len or the KV pool; the request was not queued."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_done(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED)


@dataclass(eq=False)
class Request:
    """The scheduler reads the counters; the engine owns the token lists and the per-request objects."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Position in the order of add_request calls: FCFS order, and the seed of unseeded requests.
    arrival_index: int = 0
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose K and V are in the cache (prompt chunks prefilled + tokens fed back by decode).
    num_computed_tokens: int = 0
    # KV blocks (slots) the scheduler reserved at admission; empty while waiting and after retire.
    kv_blocks: list[int] = field(default_factory=list)
    admitted_step: int | None = None
    # The last step that gave this request a token (prefill completion or decode): decode fairness.
    last_served_step: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    # Set by the engine: the StopChecker (owns the detokenizer) and the torch.Generator.
    stop_checker: Any = None
    generator: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most positions this request can ever occupy: what admission reserves."""
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def slot(self) -> int:
        """The KV slot of a slotted or contiguous cache (one block of max_seq_len tokens)."""
        if not self.kv_blocks:
            raise RuntimeError(f"request {self.request_id!r} holds no KV slot (state {self.state.value})")
        return self.kv_blocks[0]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.value}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, generated={len(self.output_ids)})"
        )


@dataclass(frozen=True)
class StepOutput:
    """One new token of one request (or its final word: an abort or a failure carries no token)."""

    request_id: str
    token_id: int | None
    # Text this token releases; "" while a multi-byte character or a possible stop string is pending.
    text_delta: str
    finished: bool
    # "stop" | "length" | "abort" when finished normally; None while running and on failure.
    finish_reason: str | None
    # Set when the request FAILED: what went wrong in its batch's forward.
    error: str | None
    prompt_tokens: int
    completion_tokens: int
