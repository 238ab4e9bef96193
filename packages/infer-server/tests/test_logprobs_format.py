"""`infer.server.logprobs` renders the engine's TokenLogprobs as OpenAI's two formats, which the
`openai` package's own types validate strictly (the client itself parses without validating)."""

import math

from openai.types.chat.chat_completion import ChoiceLogprobs as ChatLogprobs
from openai.types.completion_choice import Logprobs as CompletionLogprobs

from infer.engine.protocol import TokenLogprobs
from infer.server.logprobs import MIN_LOGPROB, ChoiceLogprobs


class LetterTokenizer:
    """Token id i is the i-th letter; 26 is "é" (two UTF-8 bytes)."""

    def decode(self, ids):
        return "".join("é" if i == 26 else chr(ord("a") + i) for i in ids)


ENTRIES = [TokenLogprobs(-0.5, [0, 1], [-0.5, -1.5]), TokenLogprobs(-2.0, [3, 0], [-0.25, -1.0])]


def test_chat_format_lists_each_token_with_its_bytes_and_alternatives():
    rendered = ChoiceLogprobs(LetterTokenizer(), chat=True).render([0, 26], ENTRIES)
    parsed = ChatLogprobs.model_validate(rendered)
    assert [(e.token, e.logprob, e.bytes) for e in parsed.content] == [
        ("a", -0.5, [97]),
        ("é", -2.0, [195, 169]),
    ]
    assert [(alt.token, alt.logprob) for alt in parsed.content[1].top_logprobs] == [("d", -0.25), ("a", -1.0)]


def test_completion_format_adds_the_sampled_token_to_the_alternatives_and_runs_offsets_on():
    logprobs = ChoiceLogprobs(LetterTokenizer(), chat=False)
    first = CompletionLogprobs.model_validate(logprobs.render([0], ENTRIES[:1]))
    second = CompletionLogprobs.model_validate(logprobs.render([26, 2], [ENTRIES[1], ENTRIES[0]]))
    assert (first.tokens, first.token_logprobs, first.text_offset) == (["a"], [-0.5], [0])
    assert first.top_logprobs == [{"a": -0.5, "b": -1.5}]
    assert second.text_offset == [1, 2]  # after "a", then after "é" (one character)
    assert second.top_logprobs[0] == {"d": -0.25, "a": -1.0, "é": -2.0}


def test_a_token_the_model_rules_out_reads_the_json_safe_floor():
    ruled_out = TokenLogprobs(-math.inf, [0], [-math.inf])
    rendered = ChoiceLogprobs(LetterTokenizer(), chat=True).render([5], [ruled_out])
    assert rendered["content"][0]["logprob"] == MIN_LOGPROB
    assert rendered["content"][0]["top_logprobs"][0]["logprob"] == MIN_LOGPROB
