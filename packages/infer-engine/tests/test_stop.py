"""Stop strings across token boundaries, stop tokens, length, and the EOS union.

The oracle for stop strings is plain `str.find` on the text received so far: generation stops
after the first delta that completes a stop string, and the emitted text is the text up to that
delta cut before the earliest stop string in it. Where no stop string contains another one, that
is the whole text cut before its earliest stop, however the text is split into deltas.
"""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infer.engine import SamplingParams, StopChecker, StopStringMatcher, collect_eos_token_ids
from infer.engine.protocol import FinishReason
from infer.engine.stop import stop_token_ids_of, token_finish_reason


def run_matcher(stop: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stop)
    emitted = []
    for delta in deltas:
        text, stopped = matcher.push(delta)
        emitted.append(text)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def cut_at_earliest_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def cut_at_first_completed_stop(deltas: list[str], stop: list[str]) -> tuple[str, bool]:
    # A stop string that would begin earlier but is not complete yet cannot be waited for: once
    # one stop string is complete, the request ends (text "#a" with stops "a" and "#aa" ends at "#").
    received = ""
    for delta in deltas:
        received += delta
        text, stopped = cut_at_earliest_stop(received, stop)
        if stopped:
            return text, True
    return received, False


def test_stop_string_spanning_three_tokens_is_not_emitted_nor_what_follows():
    emitted, stopped = run_matcher(["</answer>"], ["Paris</", "ans", "wer> and more", " text"])
    assert stopped
    assert emitted == ["Paris", "", ""]


def test_partial_match_is_held_then_released_when_it_breaks():
    emitted, stopped = run_matcher(["STOP"], ["a ST", "O", "OL"])
    assert not stopped
    assert emitted == ["a ", "", "STOOL", ""]


def test_held_partial_match_is_released_at_the_end():
    assert run_matcher(["###"], ["x #", "#"]) == (["x ", "", "##"], False)


@given(
    text=st.text(alphabet="ab#xé😀", max_size=30),
    stop=st.lists(st.text(alphabet="ab#é😀", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_any_split_of_the_text_emits_the_text_cut_at_the_first_completed_stop(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted, stopped = run_matcher(stop, deltas)
    assert ("".join(emitted), stopped) == cut_at_first_completed_stop(deltas, stop)
    if not any(a != b and a in b for a in stop for b in stop):
        assert ("".join(emitted), stopped) == cut_at_earliest_stop(text, stop)


def test_a_stop_completed_first_wins_over_a_longer_one_that_would_begin_earlier():
    assert run_matcher(["a", "#aa"], ["#a", "a"]) == (["#"], True)


class ListDetokenizer:
    """Detokenizer stand-in that maps token ids to fixed text pieces (the real one is tested below)."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def push(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


PIECES = {0: "<eos>", 1: "Hello", 2: " wor", 3: "ld", 4: "!", 5: "<eot>"}


def run_checker(params: SamplingParams, tokens: list[int], eos=(0, 5)) -> list[tuple[str, str | None]]:
    """The core's token verdict, then the frontend's text, token by token, as they run split."""
    checker = StopChecker(params, ListDetokenizer(PIECES))
    stop_token_ids = stop_token_ids_of(params, eos)
    steps = []
    for num_generated, token in enumerate(tokens, 1):
        steps.append(checker.push(token, token_finish_reason(params, stop_token_ids, num_generated, token)))
        if steps[-1][1] is not None:
            break
    return steps


def test_every_eos_id_stops_and_its_text_is_not_shown():
    for eos in (0, 5):
        assert run_checker(SamplingParams(), [1, eos, 2]) == [("Hello", None), ("", "stop")]


def test_ignore_eos_runs_to_length_but_keeps_stop_token_ids():
    params = SamplingParams(ignore_eos=True, max_new_tokens=3)
    assert run_checker(params, [1, 0, 4]) == [("Hello", None), ("<eos>", None), ("!", "length")]
    params = SamplingParams(ignore_eos=True, stop_token_ids=[4])
    assert run_checker(params, [1, 0, 4]) == [("Hello", None), ("<eos>", None), ("", "stop")]


def test_max_new_tokens_finishes_with_length_and_flushes_held_text():
    params = SamplingParams(max_new_tokens=2, stop=[" world!"])
    assert run_checker(params, [1, 2, 3]) == [("Hello", None), (" wor", "length")]


def test_stop_string_completing_on_the_last_allowed_token_is_a_stop():
    params = SamplingParams(max_new_tokens=3, stop=["world"])
    assert run_checker(params, [1, 2, 3]) == [("Hello", None), (" ", None), ("", "stop")]


def test_min_tokens_defers_every_stop_until_it_is_reached():
    # A stop string inside the first min_tokens tokens does not stop; the same later does.
    params = SamplingParams(stop=["!"], min_tokens=2, max_new_tokens=6)
    assert run_checker(params, [4, 0, 1, 4]) == [("!", None), ("<eos>", None), ("Hello", None), ("", "stop")]
    # EOS at the min_tokens-th token is still deferred; the next one stops.
    assert run_checker(SamplingParams(min_tokens=2), [1, 0, 0]) == [
        ("Hello", None),
        ("<eos>", None),
        ("", "stop"),
    ]
    # min_tokens == max_new_tokens: all text, finish length.
    params = SamplingParams(stop=["ld"], min_tokens=3, max_new_tokens=3)
    assert run_checker(params, [1, 2, 3]) == [("Hello", None), (" wor", None), ("ld", "length")]


def test_pushing_after_finish_is_an_error():
    checker = StopChecker(SamplingParams(max_new_tokens=1), ListDetokenizer(PIECES))
    checker.push(1, FinishReason.LENGTH)
    with pytest.raises(RuntimeError, match="after the request finished"):
        checker.push(1)


def write_json(path, data):
    path.write_text(json.dumps(data))


def test_qwen_style_eos_union_keeps_im_end_and_endoftext(tmp_path):
    # Qwen 3: the tokenizer's eos_token is <|endoftext|> (151643) while chat turns end with
    # <|im_end|> (151645); a chat answer must stop at the latter.
    write_json(tmp_path / "config.json", {"eos_token_id": 151643})
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [151645, 151643]})
    eos = collect_eos_token_ids(tmp_path, tokenizer_eos_token_id=151643, end_of_turn_token_id=151645)
    assert eos == {151643, 151645}


def test_eos_union_reads_every_source_and_nested_text_config(tmp_path, caplog):
    write_json(tmp_path / "config.json", {"text_config": {"eos_token_id": 1}})
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 106})
    with caplog.at_level("INFO", logger="infer.engine.eos"):
        eos = collect_eos_token_ids(tmp_path, tokenizer_eos_token_id=2, end_of_turn_token_id=107)
    assert eos == {1, 2, 106, 107}
    assert len(caplog.records) == 1 and "[1, 2, 106, 107]" in caplog.records[0].getMessage()


def test_no_eos_anywhere_is_an_error_that_names_the_fix(tmp_path):
    write_json(tmp_path / "config.json", {})
    with pytest.raises(ValueError, match="pass stop_token_ids or ignore_eos"):
        collect_eos_token_ids(tmp_path)
