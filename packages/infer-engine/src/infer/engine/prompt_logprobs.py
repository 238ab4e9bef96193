"""Prompt logprobs in the runner: every prompt token's logprob under the model's distribution at
the position before it, as vLLM's `prompt_logprobs` and OpenAI's `echo` with `logprobs` give.

Position p - 1 predicts prompt token p, and the whole prompt is known from the start, so each
prompt chunk scores itself: a chunk running positions s..e - 1 gives the logprobs of tokens
s + 1..e (up to the prompt's last, P - 1; the prompt's last position predicts the first generated
token, which the step samples). Its rows' final hidden states come out of the step's one forward
beside the sampling rows' (`ModelRunner._logits_and_hidden`, shared with pooling: the forward
returns the hidden states of `logits_indices` first, then each plan's `extra_indices` in turn),
and become logits, log_softmax, the target's logprob and rank, and the top k, a bounded number
of rows at a time (MAX_SCORED_ROWS).
The small results go to the host chunk by chunk and are handed over, whole, in the step where
the prompt ends (`RunnerOutput.prompt_logprobs`).

A request asking for them runs without the prefix cache (the core sees to it: a cached token has
no logits). One preempted before its prompt ended starts over; one resumed after it has its
prompt logprobs already (delivered with its first token) and is not scored again.
"""

from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.decision import NewRequest, PromptLogprobs
from infer.engine.input_batch import InputBatch, StepInputs

# Rows whose logits are computed at once: 256 rows of a 128k vocabulary are 128 MiB of fp32
# log-probabilities, so a 2k-token prompt chunk never holds its [chunk, vocab] logits whole.
MAX_SCORED_ROWS = 256


@dataclass(frozen=True)
class PromptLogprobsPlan:
    """One step's prompt scoring."""

    # Flat token indices whose hidden states the forward returns (after the sampling rows' and
    # pooling's), and the prompt token each predicts.
    extra_indices: np.ndarray  # [E] int64
    target_ids: np.ndarray  # [E] int64
    # Per scored chunk: (request id, its first row in extra_indices, its rows).
    chunks: tuple[tuple[str, int, int], ...]
    # Requests whose prompt ends in this step: their prompt logprobs go out with it.
    finals: tuple[str, ...]
    # The most alternatives a scored request of the step asked for.
    num_top: int


@dataclass
class _ScoredChunk:
    """A chunk's results on their way to the host (complete once a later event is)."""

    token_logprobs: torch.Tensor  # [n] float32
    ranks: torch.Tensor  # [n] int64
    top_token_ids: torch.Tensor  # [n, K] int64
    top_logprobs: torch.Tensor  # [n, K] float32


class PromptScorer:
    """The batch's prompt-logprobs requests and their chunks' results until their prompt ends."""

    def __init__(self) -> None:
        self._num_top: dict[str, int] = {}  # request id -> alternatives it asked for
        self._chunks: dict[str, list[_ScoredChunk]] = {}

    def add(self, request: NewRequest) -> None:
        """A request joins the batch (again, after a preemption: its prompt is scored over)."""
        self._chunks.pop(request.request_id, None)
        self._num_top.pop(request.request_id, None)
        wanted = request.sampling.prompt_logprobs
        if wanted is not None and len(request.token_ids) == request.num_prompt_tokens:
            self._num_top[request.request_id] = wanted
            self._chunks[request.request_id] = []

    def forget(self, request_ids) -> None:
        """Requests that left the batch (finished or preempted)."""
        for request_id in request_ids:
            self._num_top.pop(request_id, None)
            self._chunks.pop(request_id, None)

    def plan(self, step: StepInputs, batch: InputBatch) -> PromptLogprobsPlan | None:
        """The step's scoring; None when none of its rows runs a prompt that asked."""
        if not self._num_top or self._num_top.keys().isdisjoint(step.request_ids):
            return None
        sampling = set(step.sampling_rows)
        extra, targets, chunks, finals, num_top = [], [], [], [], 0
        num_extra = 0
        for row, request_id in enumerate(step.request_ids):
            if request_id not in self._num_top:
                continue
            state = batch.states[request_id]
            first, last = int(step.query_start_loc[row]), int(step.query_start_loc[row + 1])
            # The row's tokens are positions end - (last - first)..end - 1 of the request (seq_lens,
            # not step.positions, which M-RoPE models rewrite).
            end = int(step.seq_lens[row])
            start = end - (last - first)
            scored_end = min(end, state.num_prompt_tokens - 1)  # the last one a token follows
            num_top = max(num_top, self._num_top[request_id])
            if scored_end > start:
                count = scored_end - start
                extra.append(np.arange(first, first + count, dtype=np.int64))
                targets.append(batch.token_ids[state.row, start + 1 : scored_end + 1])
                chunks.append((request_id, num_extra, count))
                num_extra += count
            if row in sampling:
                finals.append(request_id)
        if not chunks and not finals:
            return None
        return PromptLogprobsPlan(
            extra_indices=np.concatenate(extra) if extra else np.zeros(0, dtype=np.int64),
            target_ids=np.concatenate(targets).astype(np.int64) if targets else np.zeros(0, dtype=np.int64),
            chunks=tuple(chunks),
            finals=tuple(finals),
            num_top=num_top,
        )

    def score(
        self, plan: PromptLogprobsPlan, hidden: torch.Tensor, compute_logits
    ) -> dict[str, "PendingPromptLogprobs"]:
        """Queues the scoring of the step's chunks from their hidden states ([E, hidden], in
        plan.extra_indices' order) and the copies of the results to the host; returns those of
        each request whose prompt ends here."""
        if plan.chunks:
            targets = torch.from_numpy(plan.target_ids).to(hidden.device, non_blocking=True)
            results = [
                _score_rows(
                    compute_logits(hidden[start : start + MAX_SCORED_ROWS]),
                    targets[start : start + MAX_SCORED_ROWS],
                    plan.num_top,
                )
                for start in range(0, len(hidden), MAX_SCORED_ROWS)
            ]
            # to("cpu", non_blocking=True) from a CUDA tensor lands in pinned memory: complete
            # once an event recorded after it is (the step's `done`, or a later step's).
            token_logprobs, ranks, top_ids, top_values = (
                torch.cat(parts).to("cpu", non_blocking=True) for parts in zip(*results, strict=True)
            )
            for request_id, first, count in plan.chunks:
                rows = slice(first, first + count)
                self._chunks[request_id].append(
                    _ScoredChunk(token_logprobs[rows], ranks[rows], top_ids[rows], top_values[rows])
                )
        # A final's prompt is done: later steps do not plan it.
        return {
            request_id: PendingPromptLogprobs(self._chunks.pop(request_id), self._num_top.pop(request_id))
            for request_id in plan.finals
        }


@dataclass
class PendingPromptLogprobs:
    """A request's prompt logprobs on their way to the host, chunk by chunk."""

    chunks: list[_ScoredChunk]
    num_top: int  # what it asked for (a step computes its largest ask for all its rows)

    def read(self) -> PromptLogprobs:
        """The PromptLogprobs, once the copies are done (after the step's `done` event)."""
        if not self.chunks:  # a prompt of one token: nothing before it predicts it
            return PromptLogprobs(
                np.zeros(0, np.float32),
                np.zeros(0, np.int64),
                np.zeros((0, self.num_top), np.int64),
                np.zeros((0, self.num_top), np.float32),
            )
        k = self.num_top
        return PromptLogprobs(
            token_logprobs=torch.cat([chunk.token_logprobs for chunk in self.chunks]).numpy(),
            ranks=torch.cat([chunk.ranks for chunk in self.chunks]).numpy(),
            top_token_ids=torch.cat([chunk.top_token_ids[:, :k] for chunk in self.chunks]).numpy(),
            top_logprobs=torch.cat([chunk.top_logprobs[:, :k] for chunk in self.chunks]).numpy(),
        )


def _score_rows(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the target's logprob, its rank, the ids and logprobs of the num_top most likely."""
    logprobs = logits.float().log_softmax(dim=-1)
    target = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > target).sum(dim=-1) + 1
    top = logprobs.topk(num_top, dim=-1)
    return target.squeeze(1), ranks, top.indices, top.values
