"""The draft-model proposer: a small model sharing the target's vocabulary drafts K tokens per
request, greedily, after each step that sampled for it.

It runs in the target's runner, through a `ModelRunner` of its own (its model, its KV pool, its
decode graphs on CUDA, the C stack on a CPU), over the target's rows: the same token ids and the
same block ids, into a pool with as many blocks as the target's, so it takes no allocator of its
own. For each request that sampled, `propose`:

    1. catches the draft's KV up: a forward over the request's tokens the draft has not
       computed (its whole prompt the first time; then the target's token, and the last draft
       if the target kept them all, as decode rows), whose last logits give draft 1;
    2. runs K - 1 decode steps, each feeding the previous draft.

After a proposal the draft's K/V holds the known tokens and drafts 1..K-1. Whatever happens
next (the target keeps drafts 1..a and puts its own token after them; or the drafts are not
verified, and later steps decode without drafting), the draft's K/V is right as far as those
drafts match the request's tokens, and the next catch-up starts there. The scheduler allocates K
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
        # Per request, from its last proposal: the known tokens then, and the drafts fed back
        # (their K/V written at those positions).
        self._proposed: dict[str, tuple[int, tuple[int, ...]]] = {}

    def forget(self, request_ids) -> None:
        """Requests whose rows went (finished, preempted): a resumed one starts over."""
        for request_id in request_ids:
            self._proposed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """K greedy drafts for each of `request_ids` (rows of the target's `batch`, whose last
        token was just sampled).

        The drafts stay on the device until all are made: each decode step feeds the previous
        step's argmax as placeholders (the runner's `last_sampled`, as async scheduling does), so
        the host builds step j + 1 while the device runs step j, and reads the drafts once."""
        request_ids = [request_id for request_id in request_ids if request_id in batch]
        if not request_ids:
            return {}
        known = [int(batch.num_tokens[batch.states[request_id].row]) for request_id in request_ids]
        # The last known token is always fed: its logits give the first draft.
        starts = [
            min(self._num_computed(batch, request_id), length - 1)
            for request_id, length in zip(request_ids, known, strict=True)
        ]
        drafts = [self._catch_up(batch, request_ids, starts, known)]  # per step, on the device
        # Draft j sits at position known - 1 + j: none past the last position a sequence may have.
        wanted = [min(self.num_speculative_tokens, self.runner.max_seq_len - length) for length in known]
        steps_active = [list(range(len(request_ids)))]
        for step in range(1, self.num_speculative_tokens):
            previous = steps_active[-1]
            active = [i for i in previous if step < wanted[i]]
            if not active:
                break
            # Row j's input is the previous step's draft at that step's index j: placeholder -1 - j.
            self.runner.last_sampled[: len(previous)].copy_(drafts[-1])
            index_in_previous = {i: j for j, i in enumerate(previous)}
            placeholders = np.array([-1 - index_in_previous[i] for i in active], dtype=np.int64)
            positions = np.array([known[i] - 1 + step for i in active], dtype=np.int64)
            drafts.append(self._decode(batch, [request_ids[i] for i in active], placeholders, positions))
            steps_active.append(active)
        proposals: list[list[int]] = [[] for _ in request_ids]
        flat = iter(torch.cat(drafts).tolist())
        for active in steps_active:
            for i in active:
                proposals[i].append(next(flat))
        for request_id, length, proposal in zip(request_ids, known, proposals, strict=True):
            # Computed now: every known token and the drafts fed back (at known .. known + k - 2).
            self._proposed[request_id] = (length, tuple(proposal[:-1]))
        return {
            request_id: tuple(proposal[: max(0, count)])
            for request_id, proposal, count in zip(request_ids, proposals, wanted, strict=True)
        }

    def _num_computed(self, batch: InputBatch, request_id: str) -> int:
        """Positions of the request whose draft K/V is right: the tokens known at its last
        proposal, and the drafts fed back then as far as the request's tokens still match them."""
        if request_id not in self._proposed:
            return 0
        length, fed = self._proposed[request_id]
        tokens = batch.history(request_id)[length : length + len(fed)]
        matching = 0
        while matching < len(tokens) and tokens[matching] == fed[matching]:
            matching += 1
        return length + matching

    def _catch_up(self, batch: InputBatch, request_ids, starts, known) -> torch.Tensor:
        """A forward over each request's uncomputed tokens; the argmax at its last token, on the
        device, in the order of `request_ids`.

        Requests little behind (the steady state: the last token, and the last draft when the
        target kept them all; or the tokens of the steps the back-off sat out) run them as
        one-token decode rows, each attending to the keys before it as a verified request's rows
        do, so that the step replays a decode graph: as many as the largest graph holds, the
        least behind first (without graphs, those at most K + 1 behind). The others (a prompt
        the draft has not seen) run as one row each of a forward of its own."""
        parts, order = [], []
        behind = [end - start for start, end in zip(starts, known, strict=True)]
        graphs = self.runner.graphs
        near, num_rows = [], 0
        for i in sorted(range(len(request_ids)), key=behind.__getitem__):
            if graphs is None and behind[i] > self.num_speculative_tokens + 1:
                break
            if graphs is not None and num_rows + behind[i] > graphs.max_batch_size:
                break
            near.append(i)
            num_rows += behind[i]
        far = sorted(set(range(len(request_ids))) - set(near))
        if near:
            rows = [(i, position) for i in near for position in range(starts[i], known[i])]
            positions = np.array([position for _, position in rows], dtype=np.int64)
            step = batch.step_inputs(
                [request_ids[i] for i, _ in rows],
                positions,
                positions + 1,
                num_decode_rows=len(rows),
                # Each request's last row: its rows are consecutive.
                sampling_rows=np.cumsum([behind[i] for i in near]) - 1,
            )
            parts.append(self._argmax(step))
            order += near
        if far:
            step = batch.step_inputs(
                [request_ids[i] for i in far],
                np.array([starts[i] for i in far], dtype=np.int64),
                np.array([known[i] for i in far], dtype=np.int64),
                num_decode_rows=0,
                sampling_rows=np.arange(len(far)),
            )
            parts.append(self._argmax(step))
            order += far
        drafts = torch.cat(parts)
        if order == sorted(order):
            return drafts
        return drafts[torch.from_numpy(np.argsort(order)).to(drafts.device)]

    def _decode(self, batch: InputBatch, request_ids, input_ids: np.ndarray, positions: np.ndarray):
        """One decode step: each request's `input_ids` (placeholders) fed at its `positions`."""
        step = batch.step_inputs(
            list(request_ids),
            positions,
            positions + 1,
            num_decode_rows=len(request_ids),
            sampling_rows=np.arange(len(request_ids)),
            input_ids=input_ids,
        )
        return self._argmax(step)

    def _argmax(self, step: StepInputs) -> torch.Tensor:
        return self.runner.draft_logits(step).argmax(dim=-1)
