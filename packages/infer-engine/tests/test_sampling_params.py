"""SamplingParams rejects each bad field with a message that names the field, the rule and the value."""

import pytest

from infer.engine import SamplingParams


def test_defaults_are_valid_and_sample_at_temperature_one():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -3, "temperature must be >= 0, got -3"),
        ("temperature", float("nan"), "temperature must be a number, got nan"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_k", -2, "top_k must be >= 1, or 0 or -1 for off, got -2"),
        ("top_k", 2.5, "top_k must be an integer, got 2.5"),
        ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0 (1.0 is off), got 0.0"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
        ("max_new_tokens", True, "max_new_tokens must be an integer, got True"),
        ("stop", "###", "stop must be a list of strings; wrap a single one: stop=['###']"),
        ("stop", [""], "every stop string must be a non-empty str, got ''"),
        ("stop_token_ids", [-1], "every stop_token_id must be an integer >= 0, got -1"),
        ("seed", "42", "seed must be an integer or None, got '42'"),
        ("logprobs", 21, "logprobs must be None or an integer in [0, 20], got 21"),
        ("logprobs", -1, "logprobs must be None or an integer in [0, 20], got -1"),
        ("logprobs", True, "logprobs must be None or an integer in [0, 20], got True"),
    ],
)
def test_bad_field_is_named_with_its_rule(field, value, message):
    with pytest.raises(ValueError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_both_mean_off(top_k):
    assert not SamplingParams(top_k=top_k).uses_top_k
