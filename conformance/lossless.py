"""Is a speculative sampler lossless? Statistical tests of the tokens it emitted against the
target distributions, shared by specs/spec_decode (SPEC-002) and the engine's unit tests
(packages/infer-engine/tests/test_spec_rejection.py, which adds the large cases).

The lossless check (`lossless_failures`) takes target distributions p_j fixed per position (not
depending on the tokens before), so the token a row emits at position j, whenever it emits one
there, is distributed exactly as p_j; and the draft at position j, once reached, is accepted with
probability sum_x min(p_j(x), q_j(x)). Per position it runs two tests:
- a chi-square goodness-of-fit test of the emitted tokens' counts against p_j, tokens pooled in
  ascending order of expected count into bins of expected count >= 5, the p-value from the
  chi-square distribution's survival function (torch.special.gammaincc: exact, no scipy), and a
  hard check that no token with p_j = 0 is ever emitted;
- the acceptance rate against sum_x min(p_j, q_j) within Hoeffding's bound
  sqrt(ln(2 / ALPHA) / (2 n)) over the n rows that reached position j.
Each test fails when its p-value (or Hoeffding's tail bound) is below ALPHA = 5e-9: a caller
running N such tests on a correct sampler fails with probability below N * ALPHA (Bonferroni),
1e-6 for N = 200.

`make_case` builds the synthetic target and draft distributions (peaked, flat, disjoint,
identical, truncated, one-hot drafts); `run_sampler` runs infer.engine.spec_decode's
rejection_sample on them.
"""

import math

import torch

from infer.engine.spec_decode import rejection_sample

# False-alarm rate of one statistical test (see the module docstring).
ALPHA = 5e-9


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts [V] to probs [V] (the tokens with probs > 0), bins pooled so that
    each has expected count >= 5; 1.0 when fewer than two bins remain (nothing to test)."""
    support = probs > 0
    observed, expected = counts[support].double(), counts.sum().double() * probs[support].double()
    order = expected.argsort()
    bins_observed, bins_expected = [], []
    pooled_observed = pooled_expected = 0.0
    for token_observed, token_expected in zip(
        observed[order].tolist(), expected[order].tolist(), strict=True
    ):
        pooled_observed += token_observed
        pooled_expected += token_expected
        if pooled_expected >= 5:
            bins_observed.append(pooled_observed)
            bins_expected.append(pooled_expected)
            pooled_observed = pooled_expected = 0.0
    if bins_expected:  # what is left (expected < 5) joins the last bin
        bins_observed[-1] += pooled_observed
        bins_expected[-1] += pooled_expected
    if len(bins_expected) < 2:
        return 1.0
    statistic = sum((o - e) ** 2 / e for o, e in zip(bins_observed, bins_expected, strict=True))
    degrees_of_freedom = len(bins_expected) - 1
    return torch.special.gammaincc(
        torch.tensor(degrees_of_freedom / 2, dtype=torch.float64),
        torch.tensor(statistic / 2, dtype=torch.float64),
    ).item()


def lossless_failures(
    outputs: list[list[int]], num_drafts: list[int], target: torch.Tensor, acceptance: torch.Tensor
) -> list[str]:
    """The tests of the module docstring on a sampler's `outputs`, for rows with `num_drafts`
    drafts each, per-position target distributions target [K + 1, V] and per-position acceptance
    probabilities acceptance [K]. Returns one line per failed test."""
    max_drafts, vocab_size = target.shape[0] - 1, target.shape[1]
    lengths = torch.tensor([len(row) for row in outputs])
    tokens = torch.tensor([token for row in outputs for token in row])
    positions = torch.arange(len(tokens)) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    counts = torch.zeros(max_drafts + 1, vocab_size, dtype=torch.int64)
    counts.index_put_((positions, tokens), torch.ones_like(tokens), accumulate=True)
    failures = []
    for j in range(max_drafts + 1):
        num_forbidden = counts[j][target[j] == 0].sum().item()
        if num_forbidden:
            failures.append(f"position {j}: {num_forbidden} tokens emitted that the target forbids")
        p_value = chi_square_p_value(counts[j], target[j])
        if p_value < ALPHA:
            failures.append(f"position {j}: chi-square p-value {p_value:.3g} over {counts[j].sum()} tokens")
    has_draft = torch.tensor(num_drafts)[:, None] > torch.arange(max_drafts)
    reached = has_draft & (lengths[:, None] > torch.arange(max_drafts))
    accepted = has_draft & (lengths[:, None] > torch.arange(1, max_drafts + 1))
    for j in range(max_drafts):
        num_reached = reached[:, j].sum().item()
        if num_reached == 0:
            continue
        rate = accepted[:, j].sum().item() / num_reached
        bound = math.sqrt(math.log(2 / ALPHA) / (2 * num_reached))
        if abs(rate - acceptance[j].item()) > bound:
            failures.append(
                f"position {j}: acceptance {rate:.4f} over {num_reached} drafts, "
                f"expected {acceptance[j].item():.4f} +- {bound:.4f}"
            )
    return failures


# Synthetic cases: target distributions p [K + 1, V] and the draft's q [K, V] (None: one-hot
# drafts, each position's draft token fixed), every position different.


def make_case(kind: str, vocab_size: int, max_drafts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = torch.randn(max_drafts + 1, vocab_size)
    if kind == "identical":
        target = (2 * logits).softmax(-1)
        return target, target[:max_drafts].clone()
    if kind == "peaked":  # target and draft both peaked, the draft a noisy copy of the target
        draft_logits = logits[:max_drafts] + 0.5 * torch.randn(max_drafts, vocab_size)
        return (4 * logits).softmax(-1), (4 * draft_logits).softmax(-1)
    if kind == "flat":  # a near-uniform target, a peaked draft
        return (0.1 * logits).softmax(-1), (4 * torch.randn(max_drafts, vocab_size)).softmax(-1)
    if kind == "disjoint":  # the target on even tokens, the draft on odd ones: nothing accepted
        target, draft = (2 * logits).softmax(-1), (2 * torch.randn(max_drafts, vocab_size)).softmax(-1)
        target[:, 1::2] = 0
        draft[:, 0::2] = 0
        return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)
    if kind == "truncated":  # a top-k target (zeros over most tokens), a draft over every token
        target = (2 * logits).softmax(-1)
        target[target < target.topk(max(2, vocab_size // 20), dim=-1).values[:, -1:]] = 0
        return target / target.sum(-1, keepdim=True), (2 * logits[:max_drafts]).softmax(-1)
    if kind == "one-hot drafts":
        return (2 * logits).softmax(-1), None
    raise ValueError(kind)


def run_sampler(
    target, draft, num_trials: int, device: str
) -> tuple[list[list[int]], list[int], torch.Tensor]:
    """Runs rejection_sample on num_trials rows, most with K drafts and a quarter with 0..K, drawn
    from the draft (or fixed, for one-hot drafts), in calls of at most ~2e7 target entries.
    Returns the outputs, each row's K_i and the theoretical acceptance per position."""
    max_drafts, vocab_size = target.shape[0] - 1, target.shape[1]
    num_drafts = torch.where(
        torch.rand(num_trials) < 0.25, torch.randint(0, max_drafts + 1, (num_trials,)), max_drafts
    ).tolist()
    if draft is None:
        # Fixed drafts: the target's likeliest token on even positions, its second on odd ones.
        likeliest = target[:max_drafts].topk(2, dim=-1).indices
        fixed = torch.where(torch.arange(max_drafts) % 2 == 0, likeliest[:, 0], likeliest[:, 1])
        drafts = fixed.expand(num_trials, max_drafts)
        acceptance = target[torch.arange(max_drafts), fixed]
    else:
        drafts = torch.multinomial(draft, num_trials, replacement=True).T
        acceptance = torch.minimum(target[:max_drafts], draft).sum(-1)
    drafts = drafts.tolist()
    rows_per_call = max(1, int(2e7 // (vocab_size * (max_drafts + 1))))
    outputs = []
    for first in range(0, num_trials, rows_per_call):
        rows = range(first, min(first + rows_per_call, num_trials))
        draft_token_ids = [drafts[row][: num_drafts[row]] for row in rows]
        target_positions = torch.cat([torch.arange(num_drafts[row] + 1) for row in rows])
        draft_positions = torch.cat([torch.arange(num_drafts[row]) for row in rows])
        outputs += rejection_sample(
            target[target_positions].to(device),
            draft_token_ids,
            None if draft is None else draft[draft_positions].to(device),
            [None] * len(rows),
        )
    return outputs, num_drafts, acceptance
