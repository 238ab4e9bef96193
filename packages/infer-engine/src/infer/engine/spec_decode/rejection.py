"""Verifying draft tokens against the target model's distributions: exact argmax match for greedy
rows (`accept_greedy`), speculative sampling for the others (`rejection_sample`).

Layout shared by both: a batch of B rows, row i with K_i draft tokens (K_i may be 0). The target
scored K_i + 1 positions for row i, consecutive and in row order: its position j (0 <= j < K_i)
is the distribution of the token at draft j's place, and position K_i the one after the last
draft (the "bonus" token). Each row emits 1..K_i + 1 tokens: its accepted drafts, then one token
of the target's.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def accept_greedy(target_tokens: torch.Tensor, draft_token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """target_tokens [P] int64: the target's argmax at each verified position (layout above).
    Per row: the drafts up to the first that differs from the target's token, then the target's
    token at that position (the bonus token when all drafts match). The emitted tokens are the
    ones greedy decoding without drafts would produce, token for token."""
    rows = _RowLayout.build(draft_token_ids, target_tokens.shape[0], target_tokens.device)
    matches = target_tokens[rows.target_index] == rows.draft_tokens
    num_accepted = rows.num_leading(matches)
    final_tokens = target_tokens[rows.target_starts + num_accepted]
    return rows.emit(draft_token_ids, num_accepted, final_tokens)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> list[list[int]]:
    """Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
    Sampling"). The emitted tokens are distributed exactly as sampling from the target alone.

    target_probs [P, V] float: each row a probability distribution p_j, after the request's
    temperature / top-k / top-p etc. (layout above). draft_probs [sum K_i, V]: the draft's
    distribution q_j at each draft position, the one draft j was sampled from; None when the drafts
    were proposed deterministically (n-gram lookup): q_j is then one-hot on draft j. generators:
    one per row, None for the process-wide RNG.

    Why each step is lossless, at draft position j with draft x ~ q_j:
    1. Accept x with probability min(1, p_j(x) / q_j(x)). The accepted token is x with
       probability q_j(x) min(1, p_j(x) / q_j(x)) = min(p_j(x), q_j(x)).
    2. On the first rejection, which happens with probability 1 - sum_x min(p_j(x), q_j(x)),
       draw from the residual norm(max(p_j - q_j, 0)) and stop. Since
       p_j(x) = min(p_j(x), q_j(x)) + max(p_j(x) - q_j(x), 0), and the residual's mass equals the
       rejection probability, accepted and residual tokens together are distributed as p_j.
    3. If all K_i drafts are accepted, draw the bonus token from p_{K_i}: no draft was proposed
       there, so this is plain sampling from the target.
    A draft with q_j(x) = 0 (it could not have been sampled from q_j) is rejected; a residual with
    no mass (p_j == q_j, where rejection has probability 0 and happens only through rounding)
    falls back to p_j, so no row divides by zero.

    Random draws: each row draws its K_i uniforms, then its one final token, from its own
    generator, so a seeded row's tokens do not depend on what else shares its batch; a row with
    K_i = 0 draws its token exactly as `infer.engine.sampler.sample` does (one multinomial).
    Rows without a generator draw together from the process-wide RNG.
    """
    if len(generators) != len(draft_token_ids):
        raise ValueError(f"one generator per row: got {len(generators)} for {len(draft_token_ids)} rows")
    device = target_probs.device
    rows = _RowLayout.build(draft_token_ids, target_probs.shape[0], device)
    if draft_probs is not None and draft_probs.shape != (rows.num_draft_tokens, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [sum K_i, V] = [{rows.num_draft_tokens}, {target_probs.shape[1]}], "
            f"got {list(draft_probs.shape)}"
        )

    # Step 1: accept draft j with probability min(1, p/q), as uniform * q < p (no division).
    p_of_draft = target_probs[rows.target_index, rows.draft_tokens]  # [B, K]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs[rows.draft_index, rows.draft_tokens]
    uniforms = _draw_uniforms(rows.num_drafts, rows.max_drafts, generators, device)
    accepted = (q_of_draft > 0) & (uniforms * q_of_draft < p_of_draft)
    num_accepted = rows.num_leading(accepted)  # [B]

    # Steps 2 and 3: each row's final token comes from p at its first rejected position
    # (minus q there) or, when all drafts were accepted, from p at the bonus position.
    final_probs = target_probs[rows.target_starts + num_accepted]  # [B, V]
    rejected = num_accepted < rows.num_drafts_tensor
    if rows.max_drafts > 0:
        # For rows with no rejection the index below is clamped to some valid position and the
        # residual it gives is discarded by the `rejected` mask.
        at_rejection = num_accepted.clamp(max=rows.max_drafts - 1)
        if draft_probs is None:
            # max(p - onehot(x), 0) is p with x's probability zeroed.
            rejected_token = rows.draft_tokens.gather(1, at_rejection[:, None])
            residual = final_probs.scatter(1, rejected_token, 0.0)
        else:
            draft_index = (rows.draft_starts + at_rejection).clamp(max=rows.num_draft_tokens - 1)
            residual = (final_probs - draft_probs[draft_index]).clamp_(min=0.0)
        has_mass = residual.sum(dim=1, keepdim=True) > 0
        # torch.multinomial normalises its weights, so the residual is not divided by its mass.
        final_probs = torch.where(rejected[:, None] & has_mass, residual, final_probs)
    final_tokens = _draw_tokens(final_probs, generators)
    return rows.emit(draft_token_ids, num_accepted, final_tokens)


@dataclass(frozen=True)
class _RowLayout:
    """Where each row's drafts and verified positions are, padded to the longest row's K."""

    num_drafts: list[int]  # [B] K_i
    num_drafts_tensor: torch.Tensor  # [B] int64
    max_drafts: int  # K = max K_i
    num_draft_tokens: int  # sum K_i
    draft_tokens: torch.Tensor  # [B, K] int64, padded with 0
    valid: torch.Tensor  # [B, K] bool: j < K_i
    target_starts: torch.Tensor  # [B] row i's first verified position
    target_index: torch.Tensor  # [B, K] verified position of draft j (0 where padded)
    draft_starts: torch.Tensor  # [B] row i's first draft position in draft_probs
    draft_index: torch.Tensor  # [B, K] draft j's position in draft_probs (0 where padded)

    @classmethod
    def build(
        cls, draft_token_ids: Sequence[Sequence[int]], num_positions: int, device: torch.device
    ) -> "_RowLayout":
        num_drafts = [len(drafts) for drafts in draft_token_ids]
        expected_positions = sum(num_drafts) + len(num_drafts)
        if num_positions != expected_positions:
            raise ValueError(
                f"the target must score K_i + 1 positions per row: {expected_positions} for drafts of "
                f"lengths {num_drafts}, got {num_positions}"
            )
        max_drafts = max(num_drafts, default=0)
        padded = [list(drafts) + [0] * (max_drafts - len(drafts)) for drafts in draft_token_ids]
        draft_tokens = torch.tensor(padded, dtype=torch.int64, device=device).view(len(padded), max_drafts)
        num_drafts_tensor = torch.tensor(num_drafts, dtype=torch.int64, device=device)
        offsets = torch.arange(max_drafts, device=device)
        valid = offsets < num_drafts_tensor[:, None]
        draft_starts = num_drafts_tensor.cumsum(0) - num_drafts_tensor
        target_starts = draft_starts + torch.arange(len(num_drafts), device=device)
        return cls(
            num_drafts=num_drafts,
            num_drafts_tensor=num_drafts_tensor,
            max_drafts=max_drafts,
            num_draft_tokens=sum(num_drafts),
            draft_tokens=draft_tokens,
            valid=valid,
            target_starts=target_starts,
            target_index=torch.where(valid, target_starts[:, None] + offsets, 0),
            draft_starts=draft_starts,
            draft_index=torch.where(valid, draft_starts[:, None] + offsets, 0),
        )

    def num_leading(self, accepted: torch.Tensor) -> torch.Tensor:
        """[B]: how many of each row's drafts are accepted before its first rejection."""
        return (accepted & self.valid).cumprod(dim=1).sum(dim=1)

    def emit(
        self, draft_token_ids: Sequence[Sequence[int]], num_accepted: torch.Tensor, final_tokens: torch.Tensor
    ) -> list[list[int]]:
        """Each row's accepted drafts followed by its final token (one copy to the host)."""
        num_accepted_list, final_list = torch.stack([num_accepted, final_tokens]).tolist()
        return [
            [*drafts[:n], token]
            for drafts, n, token in zip(draft_token_ids, num_accepted_list, final_list, strict=True)
        ]


def _draw_uniforms(
    num_drafts: list[int], max_drafts: int, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[B, K] uniforms in [0, 1): a seeded row's K_i from its own generator (nothing when K_i is
    0), the other rows' in one draw from the process-wide RNG. Padding entries are never read."""
    uniforms = torch.zeros(len(num_drafts), max_drafts, device=device)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded and max_drafts > 0:
        uniforms[unseeded] = torch.rand(len(unseeded), max_drafts, device=device)
    for row, generator in enumerate(generators):
        if generator is not None and num_drafts[row] > 0:
            uniforms[row, : num_drafts[row]] = torch.rand(num_drafts[row], generator=generator, device=device)
    return uniforms


def _draw_tokens(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[B] int64: one token per row of probs [B, V] (weights, not necessarily normalised), a
    seeded row's from its own generator, the others' in one draw from the process-wide RNG."""
    tokens = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded:
        tokens[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
    for row, generator in enumerate(generators):
        if generator is not None:
            tokens[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
    return tokens
