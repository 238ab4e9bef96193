"""Each sampler transform against transformers' logits processors and a brute-force loop.

Rows of one batch carry different settings (including "off"), so a transform that leaks one
row's value into another row, or that touches an "off" row, fails here.
"""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from infer.engine import SamplingParams
from infer.engine.sampler import (
    AllowedTokens,
    SamplingTensors,
    apply_min_p,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample,
    sample_next_tokens,
)

VOCAB_SIZE = 50


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB_SIZE, generator=generator) * 3


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_repetition_penalty_matches_transformers_per_row():
    logits = random_logits(3)
    histories = [[1, 2, 2, 7, 30], [0, 49], [5, 6]]
    penalties = [1.3, 0.7, 1.0]
    ours = apply_repetition_penalty(logits, histories, torch.tensor(penalties))
    for row, (ids, penalty) in enumerate(zip(histories, penalties, strict=True)):
        oracle = RepetitionPenaltyLogitsProcessor(penalty=penalty)(
            torch.tensor([ids]), logits[row : row + 1].clone()
        )
        torch.testing.assert_close(ours[row], oracle[0])


def test_presence_and_frequency_penalties_match_openais_formula_per_row():
    """logit[t] - frequency x count[t] - presence x (count[t] > 0), over the row's generated ids."""
    logits = random_logits(3)
    outputs = [[1, 2, 2, 7, 2], [], [49, 0, 49]]
    presence, frequency = [0.5, 1.0, -2.0], [0.25, 2.0, 1.5]
    ours = apply_presence_frequency_penalties(
        logits, outputs, torch.tensor(presence), torch.tensor(frequency)
    )
    for row, ids in enumerate(outputs):
        for token in range(VOCAB_SIZE):
            count = ids.count(token)
            expected = logits[row, token].item() - frequency[row] * count - presence[row] * (count > 0)
            assert ours[row, token].item() == pytest.approx(expected, abs=1e-5)


def test_logit_bias_and_penalties_steer_greedy_rows_as_brute_force_does():
    logits = random_logits(3, seed=4)
    params = [
        SamplingParams(temperature=0, logit_bias={3: 100.0, 9: -100.0}),
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),
        SamplingParams(temperature=0),  # untouched by its neighbours' settings
    ]
    histories = [[1, 2], [1, 2], [1, 2]]
    outputs = [[], [int(logits[1].argmax())] * 3, [5]]
    chosen = sample_next_tokens(logits, params, histories, [None] * 3, outputs).tolist()
    adjusted = logits.clone()
    adjusted[0, 3] += 100
    adjusted[0, 9] -= 100
    for token in set(outputs[1]):
        adjusted[1, token] -= 2.0 * outputs[1].count(token) + 2.0
    assert chosen == adjusted.argmax(dim=-1).tolist()
    assert (
        chosen[0] == 3 and chosen[1] != logits[1].argmax().item() and chosen[2] == logits[2].argmax().item()
    )


def test_repetition_penalty_brute_force_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0]])
    ours = apply_repetition_penalty(logits, [[0, 1, 1]], torch.tensor([2.0]))
    expected = [
        v / 2 if i in (0, 1) and v > 0 else v * 2 if i in (0, 1) else v for i, v in enumerate([2, -2, 4, -1])
    ]
    assert ours[0].tolist() == expected


def test_temperature_matches_transformers_and_leaves_greedy_rows():
    logits = random_logits(2)
    ours = apply_temperature(logits, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(ours[0], TemperatureLogitsWarper(0.5)(None, logits[:1].clone())[0])
    torch.testing.assert_close(ours[1], logits[1])


@pytest.mark.parametrize("top_k", [1, 3, 17, VOCAB_SIZE, VOCAB_SIZE + 10])
def test_top_k_matches_transformers(top_k):
    logits = random_logits(1, seed=top_k)
    ours = apply_top_k(logits, torch.tensor([top_k]))
    oracle = TopKLogitsWarper(top_k=top_k)(None, logits.clone())
    torch.testing.assert_close(ours, oracle)


def test_top_k_per_row_with_an_off_row_brute_force():
    logits = random_logits(3)
    ours = apply_top_k(logits, torch.tensor([2, 0, 5]))
    for row, k in enumerate([2, VOCAB_SIZE, 5]):
        ranked = sorted(range(VOCAB_SIZE), key=lambda i: -logits[row, i].item())
        assert kept(ours[row]) == set(ranked[:k])


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_matches_transformers(top_p):
    logits = random_logits(2, seed=int(top_p * 1000))
    ours = apply_top_p(logits, torch.tensor([top_p, top_p]))
    oracle = TopPLogitsWarper(top_p=top_p)(None, logits.clone())
    torch.testing.assert_close(ours, oracle)


def test_top_p_brute_force_keeps_the_smallest_set_reaching_p():
    logits = random_logits(3, seed=7)
    top_ps = [0.5, 1.0, 0.8]
    ours = apply_top_p(logits, torch.tensor(top_ps))
    for row, top_p in enumerate(top_ps):
        probs = logits[row].double().softmax(-1).tolist()
        ranked = sorted(range(VOCAB_SIZE), key=lambda i: -probs[i])
        chosen, mass = set(), 0.0
        for token in ranked:
            if mass >= top_p:
                break
            chosen.add(token)
            mass += probs[token]
        expected = set(range(VOCAB_SIZE)) if top_p == 1.0 else chosen
        assert kept(ours[row]) == expected


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(min_p):
    logits = random_logits(2, seed=3)
    ours = apply_min_p(logits, torch.tensor([min_p, min_p]))
    oracle = MinPLogitsWarper(min_p=min_p)(None, logits.clone())
    torch.testing.assert_close(ours, oracle)


def test_min_p_brute_force_and_off_row():
    logits = random_logits(2, seed=4)
    ours = apply_min_p(logits, torch.tensor([0.2, 0.0]))
    probs = logits[0].softmax(-1)
    assert kept(ours[0]) == {i for i in range(VOCAB_SIZE) if probs[i] >= 0.2 * probs.max()}
    torch.testing.assert_close(ours[1], logits[1])


def test_pipeline_matches_transformers_chain_in_order():
    logits = random_logits(1, seed=11)
    history = [3, 4, 5, 40]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.85, min_p=0.05, repetition_penalty=1.2)
    chain = [
        RepetitionPenaltyLogitsProcessor(1.2),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.85),
        MinPLogitsWarper(0.05),
    ]
    oracle = logits.clone()
    for processor in chain:
        oracle = processor(torch.tensor([history]), oracle)
    oracle_probs = oracle.softmax(-1)[0]
    # Many seeded draws through our pipeline only ever land on tokens the oracle keeps, and their
    # frequencies approach the oracle's probabilities.
    rng = make_generator(0, "cpu")
    num_draws = 4000
    counts = torch.zeros(VOCAB_SIZE)
    for _ in range(num_draws):
        counts[sample_next_tokens(logits, [params], [history], [rng])[0]] += 1
    assert kept(torch.where(counts > 0, 0.0, -math.inf)) <= kept(oracle[0])
    assert (counts / num_draws - oracle_probs).abs().max() < 0.03


def test_greedy_row_is_argmax_after_repetition_penalty():
    logits = torch.tensor([[5.0, 4.0, -1.0]])
    greedy = SamplingParams(temperature=0)
    assert sample_next_tokens(logits, [greedy], [[]], [None]).tolist() == [0]
    penalized = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_next_tokens(logits, [penalized], [[0]], [None]).tolist() == [1]


def test_seeded_sampling_repeats_and_ignores_batch_neighbours():
    logits = random_logits(3, seed=5)
    params = [SamplingParams(seed=123), SamplingParams(temperature=0), SamplingParams(seed=9, top_p=0.9)]

    def draws(rows: list[int], steps: int = 20) -> list[list[int]]:
        generators = [make_generator(params[row].seed, "cpu") for row in rows]
        picked = [[] for _ in rows]
        for _ in range(steps):
            tokens = sample_next_tokens(logits[rows], [params[r] for r in rows], [[]] * len(rows), generators)
            for i, token in enumerate(tokens.tolist()):
                picked[i].append(token)
        return picked

    together = draws([0, 1, 2])
    assert together == draws([0, 1, 2])
    assert together[0] == draws([0])[0]
    assert together[2] == draws([2])[0]
    assert len(set(together[0])) > 1, "temperature 1 over random logits should not draw one token 20 times"


def test_mismatched_row_counts_are_rejected():
    with pytest.raises(ValueError, match="one params, token list and generator per logits row"):
        sample_next_tokens(random_logits(2), [SamplingParams()], [[]], [None])


def test_extreme_settings_of_one_row_never_reach_its_neighbours():
    """A tiny temperature or repetition penalty overflows float32 in that row; the batch still
    samples, the neighbours draw exactly what they draw alone, and the extreme row stays valid."""
    logits = random_logits(3, seed=7) * 30
    params = [
        SamplingParams(temperature=1e-37, seed=1),
        SamplingParams(temperature=1.0, repetition_penalty=1e-39, seed=2),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    ]
    histories = [[0, 1, 2], list(range(VOCAB_SIZE)), [4]]

    def draw(rows: list[int]) -> list[int]:
        generators = [make_generator(params[row].seed, "cpu") for row in rows]
        tokens = sample_next_tokens(
            logits[rows], [params[r] for r in rows], [histories[r] for r in rows], generators
        )
        return tokens.tolist()

    together = draw([0, 1, 2])
    assert together[2] == draw([2])[0]
    assert together[0] == int(logits[0].argmax()), "a temperature this small is greedy"
    # Every id is in row 1's history: the tiny penalty sends every positive logit to the top.
    assert logits[1, together[1]] > 0


@pytest.mark.parametrize("temperature", [1e-300, 1e-37, 1e-6])
def test_temperatures_below_the_sampling_epsilon_are_greedy(temperature):
    params = SamplingParams(temperature=temperature, seed=0)
    assert params.is_greedy
    logits = random_logits(1, seed=3)
    assert sample_next_tokens(logits, [params], [[]], [make_generator(0, "cpu")]).tolist() == [
        int(logits[0].argmax())
    ]


def bitmask_of(allowed_sets: list[set[int]], vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """int32 words, bit t % 32 of word t // 32 set for each allowed token t (the grammars' layout)."""
    words = torch.zeros(len(allowed_sets), -(-vocab_size // 32), dtype=torch.int64)
    for row, allowed in enumerate(allowed_sets):
        for token in allowed:
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


EOS = 7


def constrained_sample(logits, params, allowed_sets, rows, outputs=None, *, generators=None):
    generators = generators or [make_generator(p.seed, "cpu") for p in params]
    tensors = SamplingTensors.build(params, generators, "cpu", eos_token_ids=[EOS])
    allowed = AllowedTokens(bitmask_of(allowed_sets), torch.tensor(rows))
    outputs = outputs or [[] for _ in params]
    return sample(logits, tensors, [[]] * len(params), outputs, allowed)


def test_a_grammar_row_takes_its_best_allowed_token_and_its_neighbours_are_untouched():
    logits = random_logits(3, seed=11)
    before = logits.clone()
    params = [SamplingParams(temperature=0)] * 3
    allowed = {5, 17, 40}
    chosen = constrained_sample(logits, params, [allowed], rows=[1]).tolist()
    assert chosen[1] == max(allowed, key=lambda t: logits[1, t].item())
    assert logits[1].argmax().item() not in allowed, "the seed should make the mask matter"
    assert [chosen[0], chosen[2]] == [logits[0].argmax().item(), logits[2].argmax().item()]
    assert torch.equal(logits, before), "the caller's logits are not written"


def test_sampled_grammar_rows_draw_only_allowed_tokens_after_truncation():
    logits = random_logits(2, seed=12) / 3  # flat enough that both of the top two get drawn
    allowed = [{1, 2, 3, 30, 31, 49}, {8}]
    params = [
        SamplingParams(temperature=1.5, top_k=2, seed=3),
        SamplingParams(temperature=1.0, top_p=0.5, seed=4),
    ]
    generators = [make_generator(p.seed, "cpu") for p in params]
    draws = [
        constrained_sample(logits, params, allowed, rows=[0, 1], generators=generators) for _ in range(60)
    ]
    row0 = {int(d[0]) for d in draws}
    # top-k chooses among the allowed tokens: the two best allowed ones, both drawn at 1.5.
    assert row0 == set(sorted(allowed[0], key=lambda t: -logits[0, t].item())[:2])
    assert {int(d[1]) for d in draws} == {8}


def test_no_logit_bias_brings_back_a_forbidden_token():
    logits = random_logits(1, seed=13)
    params = [SamplingParams(temperature=0, logit_bias={9: 100.0})]
    chosen = constrained_sample(logits, params, [{2, 3}], rows=[0]).tolist()
    assert chosen[0] in {2, 3}


def test_when_min_tokens_bans_all_a_grammar_allows_the_grammar_wins():
    # A finished grammar allows only EOS; min_tokens still bans EOS: the row takes EOS, and its
    # neighbour, with the same ban and no grammar, does not.
    logits = random_logits(2, seed=14)
    params = [SamplingParams(temperature=0, min_tokens=5), SamplingParams(temperature=0, min_tokens=5)]
    chosen = constrained_sample(logits, params, [{EOS}], rows=[0]).tolist()
    assert chosen[0] == EOS and chosen[1] != EOS
