"""Verifying draft tokens: `accept_greedy` against a brute-force loop, and `rejection_sample`
against the theorem it implements: the emitted tokens are distributed as the target's.

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
Each test fails when its p-value (or Hoeffding's tail bound) is below ALPHA = 5e-9. The file runs
fewer than 200 such tests on a correct sampler, so by Bonferroni a correct sampler fails this file
with probability below 1e-6 over the RNG's seeds (the seed here is fixed, so a run repeats).
"""

import math

import pytest
import torch

from infer.engine.spec_decode import accept_greedy, rejection_sample

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


LOSSLESS_CASES = [
    # kind, V, K, trials: 1e5 trials where the vocabulary is small; fewer where each trial's
    # [K + 1, V] rows cost seconds per 1e4 on a CPU core. The file ran in 17-21 s on one core of
    # a shared two-core machine (torch 2.13 CPU, 2026-11-29).
    ("identical", 2, 1, 100_000),
    ("peaked", 10, 8, 100_000),
    ("disjoint", 16, 3, 100_000),
    ("flat", 100, 4, 100_000),
    ("one-hot drafts", 100, 5, 100_000),
    ("truncated", 1000, 3, 20_000),
    ("peaked", 50_000, 2, 1_000),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
@pytest.mark.parametrize(("kind", "vocab_size", "max_drafts", "num_trials"), LOSSLESS_CASES)
def test_emitted_tokens_are_distributed_as_the_target(kind, vocab_size, max_drafts, num_trials, device):
    torch.manual_seed(vocab_size * 10 + max_drafts)
    target, draft = make_case(kind, vocab_size, max_drafts)
    outputs, num_drafts, acceptance = run_sampler(target, draft, num_trials, device)
    assert lossless_failures(outputs, num_drafts, target, acceptance) == []


# The check has power: a copy of the algorithm (`reference_sample`, every row with K drafts)
# passes it, and each one-line break of that copy fails it.

BROKEN_VARIANTS = [
    "always accept",
    "accept with probability p(x), forgetting q(x)",
    "on rejection resample from p instead of the residual",
    "residual max(q - p, 0) instead of max(p - q, 0)",
    "bonus token from p_{K-1} instead of p_K",
]


def reference_sample(
    target: torch.Tensor, draft: torch.Tensor, num_trials: int, variant: str
) -> list[list[int]]:
    max_drafts = draft.shape[0]
    drafts = torch.multinomial(draft, num_trials, replacement=True).T  # [N, K]
    positions = torch.arange(max_drafts)
    p_of_draft, q_of_draft = target[positions, drafts], draft[positions, drafts]
    accept_probability = (p_of_draft / q_of_draft).clamp(max=1)
    if variant == "always accept":
        accept_probability = torch.ones_like(p_of_draft)
    if variant == "accept with probability p(x), forgetting q(x)":
        accept_probability = p_of_draft
    accepted = torch.rand(num_trials, max_drafts) < accept_probability
    num_accepted = accepted.long().cumprod(1).sum(1)
    residual = (target[:max_drafts] - draft).clamp(min=0)
    if variant == "on rejection resample from p instead of the residual":
        residual = target[:max_drafts]
    if variant == "residual max(q - p, 0) instead of max(p - q, 0)":
        residual = (draft - target[:max_drafts]).clamp(min=0)
    bonus = target[max_drafts - 1 if variant == "bonus token from p_{K-1} instead of p_K" else max_drafts]
    final_weights = torch.cat([residual, bonus[None]])  # row n: where a row with n accepted draws
    final_tokens = torch.multinomial(final_weights[num_accepted], 1)[:, 0]
    return [
        [*row_drafts[:n], token]
        for row_drafts, n, token in zip(
            drafts.tolist(), num_accepted.tolist(), final_tokens.tolist(), strict=True
        )
    ]


def broken_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    target, draft = make_case("peaked", 10, 4)
    return target, draft, torch.minimum(target[:4], draft).sum(-1)


def test_the_check_passes_a_correct_copy_of_the_algorithm():
    target, draft, acceptance = broken_case()
    outputs = reference_sample(target, draft, 20_000, variant="correct")
    assert lossless_failures(outputs, [4] * len(outputs), target, acceptance) == []


@pytest.mark.parametrize("variant", BROKEN_VARIANTS)
def test_the_check_fails_a_broken_sampler(variant):
    target, draft, acceptance = broken_case()
    outputs = reference_sample(target, draft, 20_000, variant)
    failures = lossless_failures(outputs, [4] * len(outputs), target, acceptance)
    # The distribution test itself fails, not only the acceptance rate.
    assert any("chi-square" in failure for failure in failures), failures


# Greedy verification.


def greedy_by_loop(target_tokens: list[int], draft_token_ids: list[list[int]]) -> list[list[int]]:
    """The definition, one token at a time."""
    outputs, start = [], 0
    for drafts in draft_token_ids:
        row = []
        for j, draft in enumerate(drafts):
            row.append(target_tokens[start + j])
            if draft != target_tokens[start + j]:
                break
        else:
            row.append(target_tokens[start + len(drafts)])
        outputs.append(row)
        start += len(drafts) + 1
    return outputs


def random_greedy_batch(generator: torch.Generator, num_rows: int, vocab_size: int):
    """Target tokens and drafts that mostly copy them (so long accepted runs occur), K_i in 0..8."""
    num_drafts = torch.randint(0, 9, (num_rows,), generator=generator).tolist()
    target_tokens = torch.randint(0, vocab_size, (sum(num_drafts) + num_rows,), generator=generator)
    draft_token_ids, start = [], 0
    for k in num_drafts:
        copied = target_tokens[start : start + k].clone()
        corrupt = torch.rand(k, generator=generator) < 0.15
        copied[corrupt] = torch.randint(0, vocab_size, (int(corrupt.sum()),), generator=generator)
        draft_token_ids.append(copied.tolist())
        start += k + 1
    return target_tokens, draft_token_ids


def test_accept_greedy_matches_a_brute_force_loop():
    generator = torch.Generator().manual_seed(0)
    for vocab_size in (2, 5, 50_000):
        target_tokens, draft_token_ids = random_greedy_batch(generator, 200, vocab_size)
        expected = greedy_by_loop(target_tokens.tolist(), draft_token_ids)
        assert accept_greedy(target_tokens, draft_token_ids) == expected
    lengths = [len(row) - 1 for row in expected]
    assert 0 in lengths and 8 in lengths  # both a first-draft rejection and a full run occurred


def test_accept_greedy_edge_rows():
    # A row without drafts emits the target's token; an empty batch emits nothing.
    assert accept_greedy(torch.tensor([7, 3, 3, 9]), [[], [3, 3]]) == [[7], [3, 3, 9]]
    assert accept_greedy(torch.tensor([], dtype=torch.int64), []) == []


@pytest.mark.parametrize("explicit_draft_probs", [False, True], ids=["one-hot-drafts", "draft-probs"])
def test_one_hot_target_accepts_exactly_the_matching_prefix(explicit_draft_probs):
    """A one-hot target is greedy decoding: rejection_sample must then equal accept_greedy, with
    any draft distribution that gives the drafts nonzero probability."""
    generator = torch.Generator().manual_seed(1)
    vocab_size = 50
    target_tokens, draft_token_ids = random_greedy_batch(generator, 300, vocab_size)
    target_probs = torch.nn.functional.one_hot(target_tokens, vocab_size).float()
    draft_probs = None
    if explicit_draft_probs:
        draft_probs = torch.rand(sum(map(len, draft_token_ids)), vocab_size, generator=generator) + 0.01
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    outputs = rejection_sample(target_probs, draft_token_ids, draft_probs, [None] * len(draft_token_ids))
    assert outputs == accept_greedy(target_tokens, draft_token_ids)


# Seeds, one-hot drafts, edge cases.


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_batch(num_drafts: list[int], vocab_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    target_probs = (
        3 * torch.randn(sum(num_drafts) + len(num_drafts), vocab_size, generator=generator)
    ).softmax(-1)
    draft_probs = (3 * torch.randn(sum(num_drafts), vocab_size, generator=generator)).softmax(-1)
    draft_token_ids = [torch.randint(0, vocab_size, (k,), generator=generator).tolist() for k in num_drafts]
    return target_probs, draft_token_ids, draft_probs


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    vocab_size = 6  # small, so that rejections and acceptances both occur
    target_probs, draft_token_ids, draft_probs = random_batch([4, 0, 3, 5], vocab_size, seed=2)
    alone = [
        rejection_sample(target_probs[:5], [draft_token_ids[0]], draft_probs[:4], [seeded(seed)])[0]
        for seed in range(40)
    ]
    # The same row first in a batch with an unseeded row and two rows with seeds of their own.
    together = [
        rejection_sample(
            target_probs, draft_token_ids, draft_probs, [seeded(seed), None, seeded(seed + 1), seeded(99)]
        )[0]
        for seed in range(40)
    ]
    assert together == alone
    assert len({len(row) for row in alone}) > 1  # the seeds gave different acceptance


def test_a_row_without_drafts_samples_as_the_plain_sampler():
    """K = 0: one multinomial from the row's generator, the draw `infer.engine.sampler.sample`
    makes for a seeded row, so a request that proposes nothing gets the tokens it gets without
    speculation."""
    target_probs = torch.rand(1, 1000, generator=seeded(3)).softmax(-1)
    for seed in range(20):
        expected = torch.multinomial(target_probs[0], 1, generator=seeded(seed)).item()
        assert rejection_sample(target_probs, [[]], None, [seeded(seed)]) == [[expected]]


def test_one_hot_drafts_equal_explicit_one_hot_draft_probs():
    """draft_probs=None means q is one-hot on each draft: with the same seeds, both paths emit the
    same tokens (the same uniforms, and residuals equal to the float)."""
    vocab_size = 5
    target_probs, draft_token_ids, _ = random_batch([3, 0, 6, 2, 4], vocab_size, seed=4)
    one_hot = torch.nn.functional.one_hot(torch.tensor(sum(draft_token_ids, [])), vocab_size).float()
    for seed in range(30):
        generators = [seeded(seed + 100 * row) for row in range(5)]
        same_generators = [seeded(seed + 100 * row) for row in range(5)]
        assert rejection_sample(target_probs, draft_token_ids, None, generators) == rejection_sample(
            target_probs, draft_token_ids, one_hot, same_generators
        )


def test_a_draft_the_draft_model_gives_zero_probability_is_rejected():
    # p is one-hot on token 2 and the draft proposes 2, but q(2) = 0: rejected, and the token
    # comes from the residual max(p - q, 0) = p.
    target_probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for seed in range(10):
        assert rejection_sample(target_probs, [[2]], draft_probs, [seeded(seed)]) == [[2]]


def test_a_draft_the_target_forbids_is_rejected():
    target_probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(10):
        (row,) = rejection_sample(target_probs, [[0]], None, [seeded(seed)])
        assert len(row) == 1 and row[0] in (1, 2)


def test_a_residual_without_mass_falls_back_to_the_target():
    # p == q, so max(p - q, 0) is all zeros; the draft (q = 0) is rejected all the same, and the
    # token must come from p, not from a division by zero.
    probs = torch.tensor([0.0, 0.3, 0.7])
    target_probs = torch.stack([probs, probs])
    for seed in range(20):
        (row,) = rejection_sample(target_probs, [[0]], probs[None].clone(), [seeded(seed)])
        assert len(row) == 1 and row[0] in (1, 2)


def test_inputs_that_do_not_fit_the_layout_are_refused():
    target_probs, draft_token_ids, draft_probs = random_batch([2, 1], 4, seed=5)
    with pytest.raises(ValueError, match="K_i \\+ 1 positions per row"):
        rejection_sample(target_probs[:-1], draft_token_ids, draft_probs, [None, None])
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(target_probs, draft_token_ids, draft_probs[:-1], [None, None])
    with pytest.raises(ValueError, match="one generator per row"):
        rejection_sample(target_probs, draft_token_ids, draft_probs, [None])
