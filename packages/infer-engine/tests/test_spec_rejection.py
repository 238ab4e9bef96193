"""Verifying draft tokens: `accept_greedy` against a brute-force loop, and `rejection_sample`
against the theorem it implements: the emitted tokens are distributed as the target's.

The statistical tests (`lossless_failures`, in conformance/lossless.py, shared with
specs/spec_decode's SPEC-002) run per position a chi-square test of the emitted tokens against the
target and a Hoeffding bound on the acceptance rate, each with false-alarm rate ALPHA = 5e-9. This
file runs fewer than 200 such tests on a correct sampler, so by Bonferroni a correct sampler fails
it with probability below 1e-6 over the RNG's seeds (the seed here is fixed, so a run repeats).
"""

import pytest
import torch

from conformance.lossless import lossless_failures, make_case, run_sampler
from infer.engine.spec_decode import accept_greedy, rejection_sample

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
