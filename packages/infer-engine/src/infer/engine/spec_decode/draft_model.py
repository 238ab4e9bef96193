"""The draft-model proposer: a small model sharing the target's vocabulary drafts K tokens per
request, greedily, after each step that sampled for it.

It runs in the target's runner, through a `ModelRunner` of its own (its model, its KV pool, its
decode graphs on CUDA, the C stack on a CPU), over the target's rows: the same token ids and the
same block ids, into a pool with as many blocks as the target's, so it takes no allocator of its
own. For each request that sampled, `propose`:

    1. catches the draft's KV up: one forward over the request's tokens the draft has not
       computed (its whole prompt the first time; then the target's token, and the last draft
       if the target kept them all), whose last logits give draft 1;
    2. runs K - 1 decode steps, each feeding the previous draft.

After a proposal the draft's K/V holds the known tokens and drafts 1..K-1. The target keeps
drafts 1..a and puts its own token at the next position, the request's last known token now,
which the catch-up feeds again; so the draft's K/V is right up to the request's last known token,
whatever the verdict (or when the drafts were not verified at all). The scheduler allocates K
positions of lookahead for every request that samples (`Scheduler(num_lookahead_tokens=K)`), so
the drafts' positions have blocks.

Greedy drafts (the draft's argmax), for every request: a deterministic proposal is verified
losslessly with one-hot draft probabilities (`rejection_sample(..., draft_probs=None)`), so
sampled requests keep the target's distribution; their acceptance is what the draft's argmax
earns.
"""

from collections.abc import Sequence

import numpy as np
import torch

from infer.engine.input_batch import InputBatch, StepInputs


class DraftModelProposer:
    def __init__(self, runner, num_speculative_tokens: int):
        """`runner`: a ModelRunner over the draft model and its pool (the pool's blocks mirror
        the target's), without mixed-step graphs."""
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        # Per request: positions whose draft K/V is computed.
        self._computed: dict[str, int] = {}

    def forget(self, request_ids) -> None:
        """Requests whose rows went (finished, preempted): a resumed one starts over."""
        for request_id in request_ids:
            self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """K greedy drafts for each of `request_ids` (rows of the target's `batch`, whose last
        token was just sampled)."""
        request_ids = [request_id for request_id in request_ids if request_id in batch]
        if not request_ids:
            return {}
        known = [int(batch.num_tokens[batch.states[request_id].row]) for request_id in request_ids]
        # The last known token is always fed: its logits give the first draft.
        starts = [
            min(self._computed.get(request_id, 0), length - 1)
            for request_id, length in zip(request_ids, known, strict=True)
        ]
        drafts = self._catch_up(batch, request_ids, starts, known)
        proposals = [[token] for token in drafts]
        # Draft j sits at position known - 1 + j: none past the last position a sequence may have.
        wanted = [min(self.num_speculative_tokens, self.runner.max_seq_len - length) for length in known]
        for step in range(1, self.num_speculative_tokens):
            active = [i for i, count in enumerate(wanted) if step < count]
            if not active:
                break
            positions = [known[i] - 1 + step for i in active]
            tokens = self._decode(
                batch, [request_ids[i] for i in active], [proposals[i][-1] for i in active], positions
            )
            for i, token in zip(active, tokens, strict=True):
                proposals[i].append(token)
        for request_id, length, proposal in zip(request_ids, known, proposals, strict=True):
            # Computed now: every known token and the drafts fed back (at known .. known + k - 2).
            self._computed[request_id] = length + len(proposal) - 1
        return {
            request_id: tuple(proposal[: max(0, count)])
            for request_id, proposal, count in zip(request_ids, proposals, wanted, strict=True)
        }

    def _catch_up(self, batch: InputBatch, request_ids, starts, known) -> list[int]:
        """One forward over each request's uncomputed tokens; the argmax at its last token."""
        # Decode rows (one token) first, as every step's rows are ordered.
        order = sorted(range(len(request_ids)), key=lambda i: known[i] - starts[i] != 1)
        step_starts = np.array([starts[i] for i in order], dtype=np.int64)
        step_ends = np.array([known[i] for i in order], dtype=np.int64)
        step = batch.step_inputs(
            [request_ids[i] for i in order],
            step_starts,
            step_ends,
            num_decode_rows=int((step_ends - step_starts == 1).sum()),
            sampling_rows=np.arange(len(order)),
        )
        drafts = [0] * len(request_ids)
        for index, token in zip(order, self._argmax(step), strict=True):
            drafts[index] = token
        return drafts

    def _decode(self, batch: InputBatch, request_ids, tokens, positions) -> list[int]:
        """One decode step: each request's `tokens` fed at its `positions`."""
        positions = np.array(positions, dtype=np.int64)
        step = batch.step_inputs(
            list(request_ids),
            positions,
            positions + 1,
            num_decode_rows=len(request_ids),
            sampling_rows=np.arange(len(request_ids)),
            input_ids=np.array(tokens, dtype=np.int64),
        )
        return self._argmax(step)

    def _argmax(self, step: StepInputs) -> list[int]:
        return self.runner.draft_logits(step).argmax(dim=-1).tolist()
