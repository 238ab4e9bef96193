"""Verifying draft tokens in a step's logits: which of them the target keeps, and its own token.

A row verifying K drafts has K + 1 logits rows: position j (0..K) is the target's distribution
for the token after the row's known tokens and its drafts 0..j-1. Each position is sampled as the
request would be without speculation: the sampler's transforms (logit bias, penalties over the
tokens before that position, a grammar's mask, temperature, top-k, top-p, min-p) make the target
distribution there (`infer.engine.sampler.target_logits`). Then greedy rows keep the drafts up to
the first that is not the target's argmax (`accept_greedy`), and drawing rows run speculative
sampling (`rejection_sample`), which keeps the emitted tokens distributed as the target's.
A row without drafts is one position, sampled through the same path.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.sampler import AllowedTokens, SamplingTensors, target_logits
from infer.engine.sampling_params import SamplingParams
from infer.engine.spec_decode.rejection import accept_greedy, rejection_sample


@dataclass(frozen=True)
class VerifyRow:
    """One sampling row of a step that verifies drafts."""

    request_id: str
    sampling: SamplingParams
    generator: torch.Generator | None
    # The row's known tokens (prompt, then generated) followed by its drafts.
    token_ids: np.ndarray
    num_prompt_tokens: int
    drafts: tuple[int, ...]

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - len(self.drafts)


@dataclass(frozen=True)
class VerifiedRows:
    # Per row: its accepted drafts, then the target's token (1..K + 1 ids).
    tokens: list[list[int]]
    # Per verified position (rows' positions back to back): its request, and the token emitted
    # there (0 where the row emitted fewer tokens): compute_logprobs' inputs.
    position_request_ids: list[str]
    position_tokens: torch.Tensor  # [P] int64
    # The sampling settings of every position (its row's).
    tensors: SamplingTensors


def verify_drafts(
    logits: torch.Tensor,
    rows: Sequence[VerifyRow],
    masks: AllowedTokens | None = None,
    *,
    eos_token_ids: Collection[int] = (),
) -> VerifiedRows:
    """`logits` [P, V]: each row's K + 1 positions back to back, rows in order. `masks`: the
    grammar masks of the constrained rows' positions (their row indices are positions:
    StructuredOutput.allowed with the rows' drafts)."""
    first_position = np.cumsum([0] + [len(row.drafts) + 1 for row in rows])
    params, histories, outputs, position_ids = [], [], [], []
    for row in rows:
        for j in range(len(row.drafts) + 1):
            history = row.token_ids[: row.num_known_tokens + j]
            params.append(row.sampling)
            histories.append(history)
            outputs.append(history[row.num_prompt_tokens :])
            position_ids.append(row.request_id)
    # The positions draw with their rows' generators below, not in the sampler.
    tensors = SamplingTensors.build(params, [None] * len(params), logits.device, eos_token_ids=eos_token_ids)
    greedy_tokens, drawn_logits = target_logits(
        logits,
        tensors,
        histories if tensors.reads_token_ids else (),
        outputs if tensors.reads_output_ids else (),
        masks,
    )
    greedy_rows = [index for index, row in enumerate(rows) if row.sampling.is_greedy]
    drawing_rows = [index for index, row in enumerate(rows) if not row.sampling.is_greedy]
    tokens: list[list[int]] = [[] for _ in rows]
    if greedy_rows:
        positions = np.concatenate([np.arange(first_position[i], first_position[i + 1]) for i in greedy_rows])
        accepted = accept_greedy(
            greedy_tokens[torch.as_tensor(positions, device=greedy_tokens.device)].cpu(),
            [rows[i].drafts for i in greedy_rows],
        )
        for index, row_tokens in zip(greedy_rows, accepted, strict=True):
            tokens[index] = row_tokens
    if drawing_rows:
        # drawn_logits holds the drawing positions in position order, which is row order.
        probs = drawn_logits.softmax(dim=-1)
        accepted = rejection_sample(
            probs, [rows[i].drafts for i in drawing_rows], None, [rows[i].generator for i in drawing_rows]
        )
        for index, row_tokens in zip(drawing_rows, accepted, strict=True):
            tokens[index] = row_tokens
    position_tokens = torch.zeros(len(position_ids), dtype=torch.long)
    for index, row_tokens in enumerate(tokens):
        start = int(first_position[index])
        position_tokens[start : start + len(row_tokens)] = torch.tensor(row_tokens)
    return VerifiedRows(tokens, position_ids, position_tokens.to(logits.device), tensors)
