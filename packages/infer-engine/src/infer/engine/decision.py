"""What the scheduler tells the runner each step, and what the runner answers: plain, picklable data.

The single idea (vLLM v1): a request is `num_computed_tokens` chasing its known tokens (prompt,
then every sampled token). A prompt chunk, a decode, and a resumed (preempted) request are all
"schedule n tokens for this request"; the runner runs every scheduled token of a step in one
forward. No `Request` object crosses: a request the runner has not seen (new, or resumed after a
preemption) comes whole as a `NewRequest`; one it holds comes as a `RunningRequest` diff.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from infer.cache import BlockOp
from infer.engine.images import PromptImage
from infer.engine.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """A sampled token's logprob and its request's `logprobs` most likely alternatives (ids and
    logprobs, most likely first), of the model's raw distribution. Runner -> scheduler -> frontend."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True, eq=False)
class PromptLogprobs:
    """A request's prompt logprobs (SamplingParams.prompt_logprobs): row i is prompt token i + 1
    under the model's raw distribution at position i (the first token has none). Runner ->
    scheduler -> frontend, on the request's first output."""

    token_logprobs: np.ndarray  # [P - 1] float32: each prompt token's logprob
    ranks: np.ndarray  # [P - 1] int64: 1 + the tokens with a strictly greater logprob there
    top_token_ids: np.ndarray  # [P - 1, k] int64: the k most likely tokens there, most likely first
    top_logprobs: np.ndarray  # [P - 1, k] float32

    def __len__(self) -> int:
        return len(self.token_logprobs)


@dataclass(frozen=True)
class NewRequest:
    """A request the runner does not hold yet: new, or resumed after a preemption (recompute)."""

    request_id: str
    # Every token known so far: the prompt, then (for a resumed request) what it generated.
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    sampling: SamplingParams
    # Seed of the request's own torch.Generator (None: the process-wide RNG).
    generator_seed: int | None
    # The request's KV blocks in order: token i lives in block_ids[i // block_size].
    block_ids: tuple[int, ...]
    # Tokens whose K/V are already in those blocks before this step (0 unless a prefix cache
    # filled some).
    num_computed_tokens: int
    # A vision-language model's images: the runner encodes each when a step first computes one of
    # its tokens.
    images: tuple[PromptImage, ...] = ()


@dataclass(frozen=True)
class RunningRequest:
    """A request the runner holds: the blocks it gained since its last step, and where it stands."""

    request_id: str
    new_block_ids: tuple[int, ...]
    # Tokens whose K/V are in the cache before this step (the step computes the next ones).
    num_computed_tokens: int


@dataclass(frozen=True)
class ScheduleDecision:
    step: int
    # Scheduled this step, in the order the scheduler served them.
    new_requests: tuple[NewRequest, ...]
    running_requests: tuple[RunningRequest, ...]
    # Tokens each scheduled request runs this step: a prompt chunk's length, 1 for a decode.
    num_scheduled_tokens: dict[str, int]
    # Requests that left since the previous decision (finished, aborted, failed): rows to drop.
    finished_request_ids: frozenset[str] = frozenset()
    # Requests preempted (blocks freed, requeued) in this decision: rows to drop; they come back
    # later as NewRequest with every token they had, and recompute their KV.
    preempted_request_ids: frozenset[str] = frozenset()
    # KV block operations (infer.cache.BlockOp) to run, in order, before the forward
    # (infer.cache.kv_pool): COPY a new request's copy of the cached block its prefix match ends
    # inside (copy-on-write); OFFLOAD a prefix-cache block the tree evicts into a slot of the
    # pool's store (int8, or host memory), whose block a new owner may write in this step;
    # RESTORE a stored slot into a block a match shares.
    block_ops: tuple[BlockOp, ...] = ()
    # Scheduled tokens that are prompt (or recompute) work: all but decodes of a sampled token.
    num_prompt_tokens: int = 0
    # Speculative decoding: the draft tokens a decoding request runs after its last token (its
    # num_scheduled_tokens is 1 + K). The runner verifies them and samples 1..K + 1 tokens.
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # With a draft model: the requests it drafts for after this step, of those the step samples
    # (None: all of them); only those the next step may verify (the scheduler's back-off, and
    # disable_by_batch_size), so that its forwards run only for drafts that will be verified.
    draft_request_ids: frozenset[str] | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def scheduled_request_ids(self) -> tuple[str, ...]:
        return tuple(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(frozen=True)
class RunnerOutput:
    """Per scheduled request, the tokens sampled this step: [] for a chunk that does not end the
    known tokens (mid-prompt), one token otherwise."""

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[tuple[int, ...], ...]
    # Per request that asked for logprobs (SamplingParams.logprobs) and sampled this step: one
    # entry per sampled token.
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    # Speculative decoding with a draft model: per request that sampled, the draft's tokens for
    # its next step (the scheduler verifies what its budget allows).
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Per request whose images the vision tower encoded in this step: (images, seconds).
    images_encoded: dict[str, tuple[int, float]] = field(default_factory=dict)
    # Seconds the step's stream spent on the offloads and restores of the prefix cache's store
    # (device time on CUDA: with a host tier, its gathers, scatters and waits for restores; the
    # copies over the bus overlap the forwards), of this step or earlier ones not reported yet.
    store_transfer_s: float = 0.0
    # Per pooling request (SamplingParams.pooling) whose prompt ended in this step: its pooled
    # hidden state, [hidden_size] float32.
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
    # Per request that asked for its prompt's logprobs (SamplingParams.prompt_logprobs) and whose
    # prompt ended in this step: every prompt token's (computed chunk by chunk).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
