"""Text <-> token ids for a Hugging Face folder, and streaming detokenization.

`Tokenizer` wraps the transformers tokenizer that `AutoTokenizer` would load, with the few
operations the engine needs. `IncrementalDetokenizer` turns generated ids into text deltas one
token at a time.
"""

import re
from functools import cached_property
from os import PathLike
from pathlib import Path

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
# How many prompt tokens the detokenizer decodes before the first generated one: enough to
# give the first generated token its true left context (a leading space, a merged byte).
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """The tokenizer saved in a Hugging Face folder (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: str | PathLike):
        self.folder = Path(folder)
        self.hf_tokenizer = load_hf_tokenizer(self.folder)
        self._vocab: dict[str, int] = self.hf_tokenizer.get_vocab()
        # transformers' decode spends more time checking its arguments than the Rust decoder
        # spends decoding, and streaming decodes twice per generated token. Without a clean-up
        # pass its text is the backend's text, so go to the backend directly.
        self._backend = None
        if not self.hf_tokenizer.clean_up_tokenization_spaces:
            self._backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`. Chat prompts rendered by our templates already carry their BOS:
        encode those with add_special_tokens=False, or the BOS appears twice."""
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens); the
        model's embedding may have more rows than this, padded for alignment."""
        return len(self.hf_tokenizer)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_tokenizer.eos_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the declared special tokens and of every added token marked special."""
        added_special = (
            token_id for token_id, added in self.hf_tokenizer.added_tokens_decoder.items() if added.special
        )
        return frozenset(self.hf_tokenizer.all_special_ids) | frozenset(added_special)

    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to: the longest vocabulary entry.
        (Entries spell bytes with one symbol or more each, so an entry is never shorter than its
        text.) A text longer than n x this cannot be n tokens."""
        return max(len(token) for token in self._vocab)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the <0xXX> byte tokens of a SentencePiece-style tokenizer with byte fallback
        (Gemma); empty for byte-level BPE (Llama 3, Qwen, SmolLM2), whose tokens are all bytes."""
        model = self.hf_tokenizer.backend_tokenizer.model
        if not getattr(model, "byte_fallback", False):
            return frozenset()
        return frozenset(i for token, i in self._vocab.items() if _BYTE_TOKEN.fullmatch(token))

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, e.g. "<|im_end|>"; None when the vocabulary lacks it."""
        return self._vocab.get(token)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.folder)!r}, vocab_size={self.vocab_size})"


def load_hf_tokenizer(folder: Path):
    """The tokenizer `AutoTokenizer.from_pretrained(folder)` gives, built by the class that
    tokenizer_config.json names, without AutoTokenizer when the folder names one.

    transformers 5's AutoTokenizer reads the model's config through AutoConfig first, which
    imports the model family's modeling helpers (torch._dynamo among them), in every process that
    loads a tokenizer, both of `infer serve`'s included. SmolLM2's `Tokenizer` in a fresh process
    (torch already imported; the 2-core VM, 2026-11-30): 5.10-5.74 s through AutoTokenizer,
    2.70-3.18 s this way. test_tokenizer.py checks that the two ways give the same tokenizer."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    from infer.models.chat_template import read_tokenizer_config

    name = read_tokenizer_config(folder).get("tokenizer_class")
    named_class = tokenizer_class_from_name(name) if isinstance(name, str) else None
    if named_class is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return named_class.from_pretrained(folder)


class IncrementalDetokenizer:
    """Text deltas for generated tokens, one `push` at a time; `flush` at the end.

    Decoding each token alone is wrong twice over: a multi-byte character split across tokens
    decodes to U+FFFD, and SentencePiece / byte-level BPE decoders drop or keep a leading space
    depending on what precedes the token. So, as vLLM and TGI do, we decode a short window of
    recent tokens twice: up to the last emitted token (`prefix_offset:read_offset`) and up to
    the newest one (`prefix_offset:`); the difference is the new text. A window whose text ends
    in U+FFFD waits for the next token, since the character is not complete yet. So does one
    ending in a byte-fallback token: that decoder turns a whole run of byte tokens into U+FFFDs
    when any byte of it is invalid, so a run's text is only known once the run ends.

    The deltas concatenated equal decode(prompt + generated) minus decode(prompt); without a
    prompt they equal decode(generated).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_ids: list[int] | tuple[int, ...] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Tokens after which the text cannot be final yet: a byte token may continue its run,
        # and a skipped special token is invisible, so a run may continue across it.
        self._hold_ids = tokenizer.byte_fallback_ids
        if skip_special_tokens and tokenizer.byte_fallback_ids:
            self._hold_ids = self._hold_ids | tokenizer.special_token_ids
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # tokens before this are already emitted as text

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became stable (often "")."""
        self.ids.append(token_id)
        if token_id in self._hold_ids:
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character stays as U+FFFD, as decode gives it)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
