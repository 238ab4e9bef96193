"""Text streaming through the real tokenizers: multi-byte characters, stop strings, EOS sets.

The oracle is the tokenizer's own `decode` of all ids at once: streamed deltas must add up to
it, never show U+FFFD for a character that is merely split across tokens, and stop exactly
where `str.find` says the stop string begins.
"""

import json

import pytest
import torch

from infer.engine import SamplingParams, StopChecker, eos_token_ids_of, stream
from infer.engine.stop import stop_token_ids_of, token_finish_reason
from infer.models.load import load_model
from infer.models.loader.fetch import fetch_model
from infer.models.loader.tokenizer import IncrementalDetokenizer, Tokenizer

# 𠜎 and 🦩 are byte-fallback tokens even in Gemma's 262k vocabulary: one character, four tokens.
MULTIBYTE_TEXT = "Weather: ☀️🌧️ 東京は晴れ、北京下雨。 Emoji family 👨‍👩‍👧, 🦩 and 𠜎, café ✓ done"


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m"])
def tokenizer(request) -> Tokenizer:
    return Tokenizer(fetch_model(request.param))


def stream_text(
    tokenizer: Tokenizer, token_ids: list[int], params: SamplingParams
) -> tuple[list[str], str | None]:
    checker = StopChecker(params, IncrementalDetokenizer(tokenizer))
    deltas, finish_reason = [], None
    for num_generated, token_id in enumerate(token_ids, 1):
        text, finish_reason = checker.push(token_id, token_finish_reason(params, (), num_generated, token_id))
        deltas.append(text)
        if finish_reason is not None:
            break
    return deltas, finish_reason


def test_emoji_and_cjk_stream_whole_characters(tokenizer):
    token_ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert len(token_ids) < len(MULTIBYTE_TEXT.encode()), "the text should not be one token per byte"
    deltas, finish_reason = stream_text(tokenizer, token_ids, SamplingParams(max_new_tokens=len(token_ids)))
    assert finish_reason == "length"
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert sum(1 for delta in deltas if delta == "") > 0, "some characters span tokens and wait for the next"


@pytest.mark.parametrize("stop", ["東京は", "👩", "café ✓", "🌧️ 東", "🦩 and 𠜎"])
def test_multibyte_stop_string_cuts_the_stream_before_it(tokenizer, stop):
    token_ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    full_text = tokenizer.decode(token_ids)
    deltas, finish_reason = stream_text(tokenizer, token_ids, SamplingParams(max_new_tokens=500, stop=[stop]))
    assert finish_reason == "stop"
    assert "".join(deltas) == full_text[: full_text.find(stop)]


@pytest.fixture(scope="module")
def qwen_style_checkpoint(tmp_path_factory):
    """qwen3-tiny rewritten so that, as in the real Qwen 3 base files, the tokenizer's EOS and
    every config's eos_token_id are <|endoftext|>; only the chat template knows <|im_end|>."""
    from infer.models.random_checkpoint import make_random_checkpoint

    folder = make_random_checkpoint(
        "qwen3-tiny", tmp_path_factory.mktemp("qwen") / "ckpt", dtype=torch.float32
    )
    tokenizer = Tokenizer(folder)
    endoftext = tokenizer.token_id("<|endoftext|>")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = endoftext
        (folder / name).write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def test_qwen_chat_stops_at_im_end_even_though_eos_token_is_endoftext(qwen_style_checkpoint):
    loaded = load_model(qwen_style_checkpoint, dtype=torch.float32)
    assert loaded.tokenizer.eos_token_id == loaded.tokenizer.token_id("<|endoftext|>")
    eos_token_ids = eos_token_ids_of(loaded)
    im_end, endoftext = loaded.tokenizer.token_id("<|im_end|>"), loaded.tokenizer.token_id("<|endoftext|>")
    assert {im_end, endoftext} <= eos_token_ids
    # The stop rules honour the set: a stream ends on <|im_end|> and shows none of its text.
    params = SamplingParams()
    stop_token_ids = stop_token_ids_of(params, eos_token_ids)
    checker = StopChecker(params, IncrementalDetokenizer(loaded.tokenizer))
    hello = loaded.tokenizer.encode("Hi", add_special_tokens=False)
    pushed = [
        checker.push(token, token_finish_reason(params, stop_token_ids, n, token))
        for n, token in enumerate([*hello, im_end], 1)
    ]
    assert pushed[-1] == ("", "stop")


def test_stop_string_across_tokens_in_a_real_generation(smollm2):
    prompt_ids = smollm2.chat_ids("What is the capital of France?")
    chunks = list(stream(smollm2.engine, prompt_ids, SamplingParams(temperature=0, max_new_tokens=32)))
    full_text = "".join(chunk.text for chunk in chunks)
    # A stop string made of the end of one token's text and the start of the next.
    boundary = len("".join(chunk.text for chunk in chunks[:4]))
    stop = full_text[boundary - 2 : boundary + 3]
    assert len(stop) == 5 and full_text.find(stop) == boundary - 2
    stopped = list(
        stream(smollm2.engine, prompt_ids, SamplingParams(temperature=0, max_new_tokens=32, stop=[stop]))
    )
    assert "".join(chunk.text for chunk in stopped) == full_text[: boundary - 2]
    assert stopped[-1].finish_reason == "stop"
    assert len(stopped) < len(chunks)
