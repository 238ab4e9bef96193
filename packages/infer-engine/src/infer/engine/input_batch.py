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
    # Flat index of each sampling row's last token (the logits to compute).
    logits_indices: np.ndarray  # [R] int64
    # Speculative decoding: per sampling request (in the order of its first sampling row), the
    # draft tokens it verifies, () for none; empty when no request verifies drafts. A request
    # verifying K drafts has K + 1 rows here (see `InputBatch.prepare`).
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
        """The step's flat inputs. A request verifying K draft tokens becomes K + 1 decode rows,
        one per position, each attending to the keys before it: every decode row's K/V is
        stored before any attends (the attention kernels store the step's keys first), so row
        j sees drafts 0..j-1, as a causal forward of the K + 1 tokens would. The step then runs
        the decode paths (the CPU's C stack, the decode CUDA graphs) and gives each position's
        logits, rows of one request consecutive."""
        scheduled = decision.num_scheduled_tokens
        spec = decision.spec_token_ids
        decode_ids = [rid for rid, n in scheduled.items() if n == 1 or rid in spec]
        other_ids = [rid for rid, n in scheduled.items() if n != 1 and rid not in spec]
        # One entry per row of the step: its request, and its first and last token + 1.
        request_ids: list[str] = []
        row_starts: list[int] = []
        row_ends: list[int] = []
        for rid in decode_ids + other_ids:
            start = int(self.num_computed[self.states[rid].row])
            if rid in spec:
                request_ids.extend([rid] * scheduled[rid])
                row_starts.extend(range(start, start + scheduled[rid]))
                row_ends.extend(range(start + 1, start + scheduled[rid] + 1))
            else:
                request_ids.append(rid)
                row_starts.append(start)
                row_ends.append(start + scheduled[rid])
        rows = np.array([self.states[rid].row for rid in request_ids], dtype=np.int64)
        starts = np.array(row_starts, dtype=np.int64)
        ends = np.array(row_ends, dtype=np.int64)
        if np.any(ends > self.num_tokens[rows]):
            bad = sorted(
                {
                    rid
                    for rid, end, row in zip(request_ids, ends, rows, strict=True)
                    if end > self.num_tokens[row]
                }
            )
            raise ValueError(f"requests {bad} are scheduled past their known tokens")
        samples = ends == self.num_tokens[rows]
        if spec:
            samples |= np.array([rid in spec for rid in request_ids])
        sampling_rows = np.nonzero(samples)[0]
        sampling_ids = list(dict.fromkeys(request_ids[row] for row in sampling_rows))
        return self.step_inputs(
            request_ids,
            starts,
            ends,
            num_decode_rows=len(request_ids) - len(other_ids),
            sampling_rows=sampling_rows,
            drafts=tuple(spec.get(rid, ()) for rid in sampling_ids) if spec else (),
        )

    def step_inputs(
        self,
        request_ids: list[str],
        starts: np.ndarray,
        ends: np.ndarray,
        *,
        num_decode_rows: int,
        sampling_rows: np.ndarray,
        input_ids: np.ndarray | None = None,
        drafts: tuple[tuple[int, ...], ...] = (),
    ) -> StepInputs:
        """A step's flat arrays for rows of these requests (a request may have several), row i
        running positions starts[i]..ends[i] - 1 with the request's own block table, decode rows
        first. `input_ids`: the tokens to run (None: the rows' own tokens at those positions; a
        draft model's proposer feeds its drafts)."""
        rows = np.array([self.states[rid].row for rid in request_ids], dtype=np.int64)
        counts = ends - starts
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts, counts) + (np.arange(cu[-1]) - np.repeat(cu[:-1], counts))
        blocks = self.block_table[token_rows, positions // self.block_size].astype(np.int64)
        width = int(self.num_blocks[rows].max())
        return StepInputs(
            request_ids=request_ids,
            input_ids=self.token_ids[token_rows, positions] if input_ids is None else input_ids,
            positions=positions,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            query_start_loc=cu.astype(np.int32),
            seq_lens=ends.astype(np.int32),
            block_tables=self.block_table[rows, :width],
            num_decode_rows=num_decode_rows,
            sampling_rows=sampling_rows.tolist(),
            logits_indices=cu[1:][sampling_rows] - 1,
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
