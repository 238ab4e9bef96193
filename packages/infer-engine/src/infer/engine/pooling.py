"""Embedding requests in the runner: their prompts' final hidden states pooled into one vector.

A pooling request (SamplingParams.pooling) runs as a request of one token: its prompt goes
through the steps like any other (chunked, preempted, cached), and in the step where its prompt
ends the runner reads the final hidden states (after the model's final norm, what the LM head
reads) that step's forward returns beside the logits:
- "last": the last prompt token's, the very row whose logits the step samples from;
- "mean": the mean over every prompt token's. Each chunk's rows are added to a running sum kept
  on the device until the last chunk; the core runs such a request without the prefix cache
  (a cached token has its K/V but no hidden state) and starts its sum again when it is preempted.

`PoolingPlan` says which rows of a step's forward output are whose: the forward returns the
hidden states of the sampling rows' last tokens first (`StepInputs.logits_indices`), then those
of the mean-pooling chunks' tokens (`extra_indices`), then those prompt logprobs ask for
(infer.engine.prompt_logprobs; `ModelRunner._logits_and_hidden` runs that one forward).
"""

from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.input_batch import RowState, StepInputs


@dataclass(frozen=True)
class PoolingPlan:
    """One step's pooling work."""

    # Flat token indices whose hidden states the forward returns after the sampling rows'.
    extra_indices: np.ndarray  # [E] int64
    # Per mean-pooling chunk: (request id, its first row in the extra hidden states, its tokens).
    sums: tuple[tuple[str, int, int], ...]
    # Per pooling request whose prompt ends in this step: (request id, kind, its sampling index).
    finals: tuple[tuple[str, str, int], ...]


class Pooler:
    """The running sums of mean-pooling requests between their chunks."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()  # the batch's pooling requests
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, request_id: str, pooling: str | None) -> None:
        """A request joins the batch (again, after a preemption: its sum starts over)."""
        self._sums.pop(request_id, None)
        if pooling is not None:
            self.request_ids.add(request_id)

    def forget(self, request_ids) -> None:
        """Requests that left the batch (finished or preempted)."""
        for request_id in request_ids:
            self.request_ids.discard(request_id)
            self._sums.pop(request_id, None)

    def plan(self, step: StepInputs, states: dict[str, RowState]) -> PoolingPlan | None:
        """The step's pooling work; None when none of its rows pools."""
        if not self.request_ids or self.request_ids.isdisjoint(step.request_ids):
            return None
        sampling_index = {row: index for index, row in enumerate(step.sampling_rows)}
        extra, sums, finals = [], [], []
        num_extra = 0
        for row, request_id in enumerate(step.request_ids):
            if request_id not in self.request_ids:
                continue
            state = states[request_id]
            kind = state.sampling.pooling
            if kind == "mean":
                start, end = int(step.query_start_loc[row]), int(step.query_start_loc[row + 1])
                # Only prompt tokens count (a resumed request may run its sampled token too).
                prompt = np.flatnonzero(step.positions[start:end] < state.num_prompt_tokens) + start
                if len(prompt):
                    extra.append(prompt)
                    sums.append((request_id, num_extra, len(prompt)))
                    num_extra += len(prompt)
            if row in sampling_index:
                finals.append((request_id, kind, sampling_index[row]))
        if not sums and not finals:
            return None
        extra_indices = np.concatenate(extra) if extra else np.zeros(0, dtype=np.int64)
        return PoolingPlan(extra_indices.astype(np.int64), tuple(sums), tuple(finals))

    def pool(
        self,
        plan: PoolingPlan,
        last_hidden: torch.Tensor,
        extra_hidden: torch.Tensor,
        states: dict[str, RowState],
    ) -> dict[str, torch.Tensor]:
        """Folds the step's hidden states into the sums; returns the pooled vector ([hidden]
        float32, on the device) of each request whose prompt ended in this step."""
        for request_id, first, count in plan.sums:
            chunk = extra_hidden[first : first + count].float().sum(dim=0)
            total = self._sums.get(request_id)
            self._sums[request_id] = chunk if total is None else total + chunk
        pooled = {}
        for request_id, kind, index in plan.finals:
            if kind == "last":
                pooled[request_id] = last_hidden[index].float()
            else:
                pooled[request_id] = self._sums.pop(request_id) / states[request_id].num_prompt_tokens
        return pooled
