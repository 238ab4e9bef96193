"""The grammar layer (structured output): a GrammarSpec compiled against the model's vocabulary,
one matcher per request, and each step the bitmask of the tokens the matcher's state allows.

Built on llguidance: of the three libraries measured (docs/structured-output.md) it compiled
every grammar of the suite in at most 14 ms, filled masks fastest at batch 64, refuses the
JSON Schema keywords it cannot enforce instead of ignoring them, and is one wheel with no Python
dependencies. Its masks are computed over token bytes, so a token that crosses a grammar
boundary (`"}` closing a string and an object) is allowed exactly when its whole text is a valid
continuation, and EOS only where the output may end.

    compiler = GrammarCompiler(tokenizer.hf_tokenizer, vocab_size, eos_token_ids)  # once: ~0.3-3 s
    matcher = compiler.compile(spec).matcher()                                     # per request
    matcher.fill_bitmask(bitmask, row)   # int32 [rows, words]: the tokens allowed now
    matcher.advance(token_id)            # False: the token was not allowed (the matcher is dead)
    matcher.is_terminal                  # the output may end here

What a spec means as an llguidance grammar (JSON compact, `\\d` ASCII) is
`infer.engine.grammar_spec.llguidance_grammar`.
"""

from collections import OrderedDict

import torch

from infer.engine.grammar_spec import GrammarSpec, GrammarSpecError, llguidance_grammar


class Grammar:
    """A compiled grammar, shared by every request with its spec; `matcher()` starts one."""

    def __init__(self, initial):
        self._initial = initial  # an llguidance LLMatcher at the start state; only ever copied

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self._initial.deep_copy())


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed tokens of the current state into `bitmask[row]` (CPU int32,
        contiguous rows of ceil(vocab / 32) words)."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def advance(self, token_id: int) -> bool:
        """Moves past `token_id`; False (and the matcher is dead from then on) when the state did
        not allow it."""
        return self._matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` tokens advanced over (rejected draft tokens)."""
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    @property
    def is_terminal(self) -> bool:
        """The output may end here (EOS is allowed)."""
        return self._matcher.is_accepting()

    @property
    def is_dead(self) -> bool:
        """It refused a token (or failed): it allows nothing from then on."""
        return self._matcher.is_error()


class GrammarCompiler:
    """Compiles GrammarSpecs for one model's vocabulary. The tokenizer's view is built once
    (~0.3 s for SmolLM2's 49k tokens, ~3 s for Gemma 3's 262k); compiled grammars are kept in
    an LRU of `max_cached` specs, so a repeated schema compiles once."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, *, max_cached: int = 256):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self.max_cached = max_cached

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The spec's grammar; GrammarSpecError when it cannot be enforced (llguidance's reason)."""
        grammar = self._cache.get(spec)
        if grammar is not None:
            self._cache.move_to_end(spec)
            return grammar
        grammar = Grammar(self._matcher_for(spec))
        self._cache[spec] = grammar
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return grammar

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of `num_rows` rows for `fill_bitmask` (pinned where CUDA is, so its
        copy to the GPU does not wait)."""
        return torch.full(
            (num_rows, self.num_words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available()
        )

    def _matcher_for(self, spec: GrammarSpec):
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, llguidance_grammar(spec), log_level=0)
        if matcher.is_error():  # llguidance never raises for a grammar; it reports
            raise GrammarSpecError(
                f"the {spec.kind} cannot be enforced: {matcher.get_error().splitlines()[0]}"
            )
        return matcher
