"""Tokenizer and IncrementalDetokenizer on the two real tokenizers (byte-level BPE and
SentencePiece with byte fallback). The oracle for streaming is transformers' one-shot decode."""

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.models.loader.fetch import fetch_model
from infer.models.loader.tokenizer import IncrementalDetokenizer, Tokenizer

ALIASES = ["smollm2-135m-instruct", "gemma-3-270m"]
REPLACEMENT_CHAR = "\ufffd"
# Emoji (one with a ZWJ sequence and a skin tone), CJK, rare CJK (extension B, split into bytes
# by both tokenizers), combining accents, leading/double spaces and newlines.
TEXTS = [
    "Hello world",
    "  leading spaces and a tab\tthen\nnewlines\n\n",
    "Emoji: 😀 👩‍👩‍👧 👍🏽 🇫🇷 end",
    "中文测试：你好，世界！日本語のテキストも。",
    "Rare: 𠜎𠜱𡃁 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and e\u0301 à la carte",
    "mixed 😀中 a😀b 中😀文 ",
]


@functools.cache
def load_tokenizer(alias: str) -> Tokenizer:
    return Tokenizer(fetch_model(alias))


@pytest.fixture(scope="module", params=ALIASES)
def tokenizer(request) -> Tokenizer:
    return load_tokenizer(request.param)


def _stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] = ()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    deltas = [detokenizer.push(token_id) for token_id in ids]
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_one_shot_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    full = tokenizer.hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_characters_split_across_tokens_are_held_back_not_emitted_broken(tokenizer):
    # Rare characters are spelled in bytes by both tokenizers: some pushes must return "".
    ids = tokenizer.encode("𠜎𠜱𡃁", add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    assert len(ids) > 3, "each rare character should take several tokens"
    assert "" in deltas[:-1]
    assert "".join(deltas) == "𠜎𠜱𡃁"


@pytest.mark.parametrize("text", TEXTS)
def test_with_a_prompt_the_deltas_are_the_text_after_the_prompt(tokenizer, text):
    # After a prompt, the first generated token keeps its leading space (SentencePiece drops it
    # at the start of a decode), so the oracle is decode(prompt + generated) minus decode(prompt).
    prompt_ids = tokenizer.encode("The answer is", add_special_tokens=False)
    generated = tokenizer.encode(" " + text, add_special_tokens=False)
    deltas = _stream(tokenizer, generated, prompt_ids)
    prompt_text = tokenizer.hf_tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.hf_tokenizer.decode(prompt_ids + generated, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    assert "".join(deltas) == full[len(prompt_text) :]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_token_sequence_streams_to_its_decode(tokenizer, data):
    # Models emit arbitrary sequences, lone continuation bytes included.
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=24))
    assert "".join(_stream(tokenizer, ids)) == tokenizer.hf_tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_decode_equals_transformers_decode(tokenizer, data):
    # Our decode skips transformers' wrapper for speed; the text must not change.
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=24))
    skip_special_tokens = data.draw(st.booleans())
    expected = tokenizer.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@functools.cache
def _tokenizer_json(folder) -> dict:
    # Read straight from tokenizer.json, independently of transformers.
    return json.loads((folder / "tokenizer.json").read_text())


def _added_tokens(folder) -> dict[str, int]:
    return {entry["content"]: entry["id"] for entry in _tokenizer_json(folder)["added_tokens"]}


@pytest.mark.parametrize(
    ("alias", "end_of_turn"), [("smollm2-135m-instruct", "<|im_end|>"), ("gemma-3-270m", "<end_of_turn>")]
)
def test_end_of_turn_token_is_found_by_name(alias, end_of_turn):
    tokenizer = load_tokenizer(alias)
    expected_id = _added_tokens(tokenizer.folder)[end_of_turn]
    assert tokenizer.token_id(end_of_turn) == expected_id
    assert tokenizer.token_id("<|no such token|>") is None


def test_special_token_ids_cover_bos_eos_and_the_special_added_tokens(tokenizer):
    tokenizer_json = _tokenizer_json(tokenizer.folder)
    special_added = {entry["id"] for entry in tokenizer_json["added_tokens"] if entry["special"]}
    assert special_added <= tokenizer.special_token_ids
    assert {tokenizer.bos_token_id, tokenizer.eos_token_id} <= tokenizer.special_token_ids


def test_add_special_tokens_controls_the_gemma_bos():
    tokenizer = load_tokenizer("gemma-3-270m")
    with_bos = tokenizer.encode("Hello", add_special_tokens=True)
    without = tokenizer.encode("Hello", add_special_tokens=False)
    assert with_bos == [tokenizer.bos_token_id, *without]


def test_vocab_size_counts_every_id_the_tokenizer_can_produce(tokenizer):
    tokenizer_json = _tokenizer_json(tokenizer.folder)
    highest_id = max(
        max(_vocab_ids(tokenizer_json["model"]["vocab"])),
        max(entry["id"] for entry in tokenizer_json["added_tokens"]),
    )
    assert tokenizer.vocab_size == highest_id + 1


def _vocab_ids(vocab) -> list[int]:
    # BPE stores {token: id}; Unigram stores [[token, score], ...] in id order.
    return list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_max_token_chars_bounds_every_tokens_text(alias):
    """The server's default prompt limit is max_model_len x this: no token may decode longer."""
    tokenizer = load_tokenizer(alias)
    longest = max(len(tokenizer.decode([token_id])) for token_id in range(tokenizer.vocab_size))
    assert longest <= tokenizer.max_token_chars


@pytest.fixture(scope="module")
def random_checkpoint_folder(tmp_path_factory):
    """A random checkpoint's folder: its tokenizer_config.json names PreTrainedTokenizerFast."""
    from infer.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), weights=False)


@pytest.mark.parametrize("source", [*ALIASES, "random checkpoint"])
def test_the_tokenizer_is_the_one_auto_tokenizer_loads(source, request):
    """`load_hf_tokenizer` skips AutoTokenizer (see its doc); the oracle is AutoTokenizer itself."""
    from transformers import AutoTokenizer

    if source == "random checkpoint":
        folder = request.getfixturevalue("random_checkpoint_folder")
        ours = Tokenizer(folder).hf_tokenizer
    else:
        folder = fetch_model(source)
        ours = load_tokenizer(source).hf_tokenizer
    auto = AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_ids == auto.all_special_ids
    added = {i: (token.content, token.special) for i, token in auto.added_tokens_decoder.items()}
    assert {i: (token.content, token.special) for i, token in ours.added_tokens_decoder.items()} == added
    assert ours.clean_up_tokenization_spaces == auto.clean_up_tokenization_spaces
    specials = "".join(token for token, _ in added.values())
    for text in [*TEXTS, specials + " and text " + specials]:
        for add_special_tokens in (True, False):
            ids = auto.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids
            for skip in (True, False):
                expected = auto.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected
