"""The runner's persistent view of the requests it holds: one row of host arrays per request.

Rows are filled when a request arrives (`add`), grown by the decision's diffs (`update`), and
freed when it leaves (`remove`); nothing is rebuilt from scratch per step. `prepare(decision)`
turns one step's scheduled tokens into the flat arrays of a ForwardBatch with a few numpy
gathers: decode rows (one token) first, then the others, each in the decision's order.

Token ids live here, not in the scheduler's Request: the runner appends what it samples, so a
decode needs nothing from the scheduler but "one more token for this request". A sampled token
whose id is still on the device is a placeholder here, -(1 + j) for the j-th token its step
sampled; `resolve_pending_tokens` swaps placeholders for the ids on the device (runner.py).
"""

from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.decision import NewRequest, RunningRequest, ScheduleDecision
from infer.engine.sampler import make_generator
from infer.engine.sampling_params import SamplingParams


def resolve_pending_tokens(input_ids: torch.Tensor, last_sampled: torch.Tensor) -> None:
    """In place: each placeholder id -(1 + j) becomes last_sampled[j]; other ids stay. Graph-safe
    (no host sync), so the step graphs run it as their first node."""
    index = (-1 - input_ids).clamp_(min=0)
    input_ids.copy_(torch.where(input_ids < 0, last_sampled[index], input_ids))


@dataclass
class RowState:
    """What the runner keeps per request besides its arrays."""

    row: int
    sampling: SamplingParams
    generator: torch.Generator | None
    # Where the generated ids start in the row (presence and frequency penalties read them).
    num_prompt_tokens: int


@dataclass(frozen=True)
class StepInputs:
    """One step's flat inputs (host arrays), decode rows first."""

    request_ids: list[str]
    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    num_decode_rows: int
    # Rows whose last scheduled token is their last known token: they sample this step.
    sampling_rows: list[int]
    # Flat index of each sampling row's last token (the logits to compute); a row verifying K
    # draft tokens has K + 1 of them: its last known token's and each draft's.
    logits_indices: np.ndarray  # [sum over sampling rows of 1 + K] int64
    # Per sampling row, the draft tokens it verifies (speculative decoding); () for none.
    drafts: tuple[tuple[int, ...], ...] = ()

    @property
    def verifies_drafts(self) -> bool:
        return any(self.drafts)


class InputBatch:
    def __init__(self, *, max_rows: int, max_seq_len: int, block_size: int, device: torch.device):
        self.max_rows = max_rows
        self.block_size = block_size
        self.max_blocks = -(-max_seq_len // block_size)
        self.device = device
        self.token_ids = np.zeros((max_rows, max_seq_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_computed = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.states: dict[str, RowState] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __len__(self) -> int:
        return len(self.states)

    def add(self, request: NewRequest) -> None:
        if request.request_id in self.states:
            raise ValueError(f"request {request.request_id!r} already has a row")
        if not self._free_rows:
            raise ValueError(f"all {self.max_rows} rows are taken; the scheduler must keep to max_batch_size")
        row = self._free_rows.pop()
        num_tokens = len(request.token_ids)
        self.token_ids[row, :num_tokens] = request.token_ids
        self.num_tokens[row] = num_tokens
        self.num_computed[row] = request.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, request.block_ids)
        self.states[request.request_id] = RowState(
            row=row,
            sampling=request.sampling,
            generator=make_generator(request.generator_seed, self.device),
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def update(self, request: RunningRequest) -> None:
        row = self.states[request.request_id].row
        self.num_computed[row] = request.num_computed_tokens
        self._append_blocks(row, request.new_block_ids)

    def remove(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def append_token(self, request_id: str, token_id: int) -> int:
        """Appends a token (or a placeholder, see runner.py) to the request's row; returns its
        position."""
        row = self.states[request_id].row
        position = int(self.num_tokens[row])
        self.token_ids[row, position] = token_id
        self.num_tokens[row] = position + 1
        return position

    def history(self, request_id: str) -> np.ndarray:
        """Every token of the request so far (prompt and generated)."""
        row = self.states[request_id].row
        return self.token_ids[row, : self.num_tokens[row]]

    def output_ids(self, request_id: str) -> np.ndarray:
        """The tokens the request generated so far."""
        state = self.states[request_id]
        return self.token_ids[state.row, state.num_prompt_tokens : self.num_tokens[state.row]]

    def apply(self, decision: ScheduleDecision) -> None:
        """Drops the rows that left, adds the new requests, grows the running ones."""
        for request_id in decision.finished_request_ids | decision.preempted_request_ids:
            self.remove(request_id)
        for request in decision.new_requests:
            self.add(request)
        for request in decision.running_requests:
            self.update(request)
        # Draft tokens join their rows for the step that verifies them; the runner then keeps
        # the accepted ones (`truncate`, then `append_token`).
        for request_id, drafts in decision.spec_token_ids.items():
            row = self.states[request_id].row
            start = int(self.num_tokens[row])
            self.token_ids[row, start : start + len(drafts)] = drafts
            self.num_tokens[row] = start + len(drafts)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Drops the row's tokens from position num_tokens on (rejected drafts)."""
        self.num_tokens[self.states[request_id].row] = num_tokens

    def prepare(self, decision: ScheduleDecision) -> StepInputs:
        scheduled = decision.num_scheduled_tokens
        decode_ids = [rid for rid, n in scheduled.items() if n == 1]
        other_ids = [rid for rid, n in scheduled.items() if n != 1]
        request_ids = decode_ids + other_ids
        rows = np.array([self.states[rid].row for rid in request_ids], dtype=np.int64)
        counts = np.array([scheduled[rid] for rid in request_ids], dtype=np.int64)
        starts = self.num_computed[rows]
        ends = starts + counts
        if np.any(ends > self.num_tokens[rows]):
            bad = [
                rid
                for rid, end, row in zip(request_ids, ends, rows, strict=True)
                if end > self.num_tokens[row]
            ]
            raise ValueError(f"requests {bad} are scheduled past their known tokens")
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts, counts) + (np.arange(cu[-1]) - np.repeat(cu[:-1], counts))
        blocks = self.block_table[token_rows, positions // self.block_size].astype(np.int64)
        sampling_rows = np.nonzero(ends == self.num_tokens[rows])[0]
        spec = decision.spec_token_ids
        drafts = tuple(spec.get(request_ids[row], ()) for row in sampling_rows) if spec else ()
        last = cu[1:][sampling_rows] - 1
        if drafts:
            num_drafts = np.array([len(row_drafts) for row_drafts in drafts], dtype=np.int64)
            # Each row's last K + 1 tokens: its last known token and its K drafts.
            per_row = num_drafts + 1
            starts_out = np.cumsum(per_row) - per_row
            offsets = np.arange(int(per_row.sum())) - np.repeat(starts_out, per_row)
            logits_indices = np.repeat(last - num_drafts, per_row) + offsets
        else:
            logits_indices = last
        width = int(self.num_blocks[rows].max())
        return StepInputs(
            request_ids=request_ids,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            query_start_loc=cu.astype(np.int32),
            seq_lens=ends.astype(np.int32),
            block_tables=self.block_table[rows, :width],
            num_decode_rows=len(decode_ids),
            sampling_rows=sampling_rows.tolist(),
            logits_indices=logits_indices,
            drafts=drafts,
        )

    def _append_blocks(self, row: int, block_ids) -> None:
        count = len(block_ids)
        if not count:
            return
        start = self.num_blocks[row]
        if start + count > self.max_blocks:
            raise ValueError(f"row {row} would hold {start + count} blocks, at most {self.max_blocks} fit")
        self.block_table[row, start : start + count] = block_ids
        self.num_blocks[row] = start + count
