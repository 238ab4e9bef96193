"""NgramProposer against a brute-force oracle of vLLM's prompt-lookup rules: the longest suffix
n-gram (prompt_lookup_max down to prompt_lookup_min) that recurs earlier, its earliest copy, and
the up to num_speculative_tokens tokens after it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.engine.spec_decode import NgramProposer


def brute_force_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Plain loops: for n from max_n down to min_n, the first earlier start whose n tokens equal
    the last n; the draft is what follows that copy."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(tokens: list[int], k: int = 4, min_n: int = 2, max_n: int = 4) -> list[int]:
    return NgramProposer(k, min_n, max_n).propose(np.array(tokens, dtype=np.int64))


def test_vllm_docstring_example():
    # vllm/v1/spec_decode/ngram_proposer.py's example: [4, 2, 3] has no earlier copy, [2, 3]
    # does, and only three tokens follow it.
    assert propose([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=3) == [4, 2, 3]


def test_longest_ngram_wins_over_an_earlier_shorter_one():
    # [7, 8] occurs first at 0 (followed by 1), but [6, 7, 8] occurs at 3 (followed by 2).
    tokens = [7, 8, 1, 6, 7, 8, 2, 5, 6, 7, 8]
    assert propose(tokens, k=1, min_n=2, max_n=3) == [2]
    assert propose(tokens, k=1, min_n=2, max_n=2) == [1]


def test_earliest_copy_of_the_ngram_is_taken():
    assert propose([5, 6, 1, 5, 6, 2, 5, 6], k=1, min_n=2, max_n=2) == [1]


def test_too_short_sequence_proposes_nothing():
    assert propose([], min_n=1, max_n=1) == []
    assert propose([3], min_n=1, max_n=1) == []
    assert propose([3, 3], min_n=2, max_n=4) == []


def test_no_recurring_suffix_proposes_nothing():
    assert propose(list(range(100)), min_n=1, max_n=4) == []
    # The last token recurs but no 2-gram does.
    assert propose([1, 2, 3, 9, 4, 3], min_n=2, max_n=4) == []


def test_copy_overlapping_the_suffix():
    # A run of one token: the suffix [9, 9, 9] recurs one position back, overlapping itself, and
    # only one token follows that copy.
    assert propose([1, 9, 9, 9, 9], k=4, min_n=2, max_n=3) == [9]
    assert propose([1, 2, 1, 2, 1, 2], k=4, min_n=2, max_n=4) == [1, 2]


def test_draft_is_cut_at_the_end_of_the_sequence():
    assert propose([1, 2, 3, 1, 2], k=8, min_n=2, max_n=2) == [3, 1, 2]


def test_draft_is_num_speculative_tokens_long_when_enough_tokens_follow():
    tokens = list(range(20)) + [0, 1]
    assert propose(tokens, k=5, min_n=2, max_n=4) == [2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("field", "args"),
    [
        ("num_speculative_tokens", (0, 1, 2)),
        ("prompt_lookup_min", (4, 0, 2)),
        ("prompt_lookup_max", (4, 1, 0)),
        ("prompt_lookup_min must be <= prompt_lookup_max", (4, 3, 2)),
    ],
)
def test_invalid_settings_name_the_field(field, args):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)


proposer_settings = st.tuples(
    st.integers(1, 8),  # num_speculative_tokens
    st.integers(1, 5),  # prompt_lookup_min
    st.integers(0, 3),  # prompt_lookup_max - prompt_lookup_min
)


@settings(max_examples=400, deadline=None)
@given(proposer_settings, st.lists(st.integers(0, 3), max_size=60))
def test_matches_brute_force_on_small_alphabets(config, tokens):
    # Four symbols: many recurring n-grams, ties and overlaps.
    k, min_n, extra = config
    assert propose(tokens, k, min_n, min_n + extra) == brute_force_draft(tokens, k, min_n, min_n + extra)


@settings(max_examples=200, deadline=None)
@given(
    proposer_settings,
    st.lists(st.integers(0, 50_000), min_size=1, max_size=12),
    st.lists(st.integers(0, 50_000), max_size=30),
    st.integers(0, 12),
)
def test_matches_brute_force_on_copied_passages(config, passage, filler, cut):
    # The copy-heavy shape: a passage, other text, then the passage again up to a cut.
    k, min_n, extra = config
    tokens = passage + filler + passage[:cut]
    assert propose(tokens, k, min_n, min_n + extra) == brute_force_draft(tokens, k, min_n, min_n + extra)


def test_matches_brute_force_on_long_random_sequences():
    rng = np.random.default_rng(0)
    for vocab in (2, 8, 1000):
        tokens = rng.integers(0, vocab, size=2000).tolist()
        for min_n, max_n in ((1, 1), (2, 4), (3, 5)):
            assert propose(tokens, 6, min_n, max_n) == brute_force_draft(tokens, 6, min_n, max_n)
