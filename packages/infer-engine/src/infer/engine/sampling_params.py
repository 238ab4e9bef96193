"""How one request wants its tokens chosen and when it wants to stop."""

import math
from dataclasses import dataclass, field

from infer.engine.grammar_spec import GrammarSpec

# Temperatures below this sample greedily, as in vLLM: dividing logits by them overflows float32
# (1e-37), or they round to 0 in float32 (1e-300), and either way the distribution is the argmax.
SAMPLING_EPS = 1e-5
# The most alternatives a sampled token's logprobs may list (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# How an embedding request pools its prompt's final hidden states (after the final norm): the
# last token's (what decoder-only embedding models such as Qwen3-Embedding are trained for, and
# vLLM's default for them) or the mean over every prompt token.
POOLING_TYPES = ("last", "mean")


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings, checked when built.

    The transforms run in this order (see `infer.engine.sampler`): logit bias, repetition
    penalty, presence and frequency penalties, temperature (below SAMPLING_EPS = 1e-5: greedy
    argmax), top-k, top-p, min-p, then a draw from a generator seeded with `seed` (None: the
    process-wide torch RNG).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: off.
    top_k: int = 0
    min_p: float = 0.0
    # 1.0: off. HF semantics over prompt + generated ids: positive logits divided, negative multiplied.
    repetition_penalty: float = 1.0
    # OpenAI semantics over the generated ids only, in [-2, 2] (0: off): a token's logit loses
    # presence_penalty once if it was generated, and frequency_penalty per time it was generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Token id -> a value in [-100, 100] added to its logit before anything else (OpenAI's
    # logit_bias; -100 bans a token, +100 all but forces it).
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_new_tokens: int = 256
    # vLLM's min_tokens: until this many tokens are generated, EOS and stop_token_ids cannot be
    # sampled and stop strings are not looked for (in the text of the tokens from then on).
    min_tokens: int = 0
    # Text that ends the request; the stop string itself is not part of the output.
    stop: list[str] = field(default_factory=list)
    # Token ids that end the request besides the model's EOS set (honoured even with ignore_eos).
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # Keep generating through EOS tokens until max_new_tokens (benchmarks use this).
    ignore_eos: bool = False
    # Return each sampled token's logprob and this many most likely alternatives (0..MAX_LOGPROBS);
    # None: no logprobs. They are of the model's raw distribution (log_softmax of its logits,
    # before logit bias, penalties, temperature and truncation), as vLLM returns by default.
    logprobs: int | None = None
    # Return every prompt token's logprob (from position 1 on: under the distribution the model
    # gives at the position before), its rank, and this many most likely alternatives there
    # (0..MAX_LOGPROBS), as vLLM's prompt_logprobs; None: none. Raw, as `logprobs`. Such a request
    # computes its whole prompt (no prefix-cache reuse: a cached token has no logits).
    prompt_logprobs: int | None = None
    # Structured output: what the whole output must be (a JSON schema, any JSON object, a regex,
    # or a Lark grammar); the engine allows only tokens that keep it possible, and EOS once it is
    # complete.
    grammar: GrammarSpec | None = None
    # An embedding request (POOLING_TYPES): its output is the pooled hidden state of its prompt
    # (EngineOutput.embedding), with the one token its step samples beside it, never shown, so
    # that it runs, is preempted and finishes as any request of one token does.
    pooling: str | None = None

    def __post_init__(self):
        _require(_is_number(self.temperature), "temperature must be a number", self.temperature)
        _require(self.temperature >= 0, "temperature must be >= 0", self.temperature)
        _require(_is_number(self.top_p), "top_p must be a number", self.top_p)
        _require(0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p)
        _require(_is_int(self.top_k), "top_k must be an integer", self.top_k)
        _require(self.top_k >= -1, "top_k must be >= 1, or 0 or -1 for off", self.top_k)
        _require(_is_number(self.min_p), "min_p must be a number", self.min_p)
        _require(0 <= self.min_p <= 1, "min_p must be in [0, 1]", self.min_p)
        _require(
            _is_number(self.repetition_penalty),
            "repetition_penalty must be a number",
            self.repetition_penalty,
        )
        _require(
            self.repetition_penalty > 0,
            "repetition_penalty must be > 0 (1.0 is off)",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value), f"{name} must be a number", value)
            _require(-2 <= value <= 2, f"{name} must be in [-2, 2]", value)
        _require(
            isinstance(self.logit_bias, dict),
            "logit_bias must be a dict of token id -> bias",
            self.logit_bias,
        )
        for token_id, bias in self.logit_bias.items():
            _require(_is_int(token_id) and token_id >= 0, "logit_bias keys must be token ids >= 0", token_id)
            _require(
                _is_number(bias) and -100 <= bias <= 100, "logit_bias values must be in [-100, 100]", bias
            )
        self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}
        _require(_is_int(self.max_new_tokens), "max_new_tokens must be an integer", self.max_new_tokens)
        _require(self.max_new_tokens >= 1, "max_new_tokens must be >= 1", self.max_new_tokens)
        _require(_is_int(self.min_tokens), "min_tokens must be an integer", self.min_tokens)
        _require(
            0 <= self.min_tokens <= self.max_new_tokens,
            f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}]",
            self.min_tokens,
        )
        _require(
            not isinstance(self.stop, str),
            f"stop must be a list of strings; wrap a single one: stop=[{self.stop!r}]",
            self.stop,
        )
        self.stop = list(self.stop)
        for text in self.stop:
            _require(isinstance(text, str) and text != "", "every stop string must be a non-empty str", text)
        self.stop_token_ids = list(self.stop_token_ids)
        for token_id in self.stop_token_ids:
            _require(
                _is_int(token_id) and token_id >= 0, "every stop_token_id must be an integer >= 0", token_id
            )
        _require(self.seed is None or _is_int(self.seed), "seed must be an integer or None", self.seed)
        _require(
            self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )
        _require(
            self.prompt_logprobs is None
            or _is_int(self.prompt_logprobs)
            and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}]",
            self.prompt_logprobs,
        )

        _require(
            self.grammar is None or isinstance(self.grammar, GrammarSpec),
            "grammar must be a GrammarSpec or None",
            self.grammar,
        )
        _require(
            self.grammar is None or not self.ignore_eos,
            "ignore_eos cannot be combined with a grammar (the grammar decides where the output ends)",
            self.ignore_eos,
        )
        _require(
            self.pooling is None or self.pooling in POOLING_TYPES,
            f"pooling must be None or one of {', '.join(POOLING_TYPES)}",
            self.pooling,
        )
        _require(
            self.pooling is None or self.max_new_tokens == 1 and self.grammar is None,
            "a pooling request runs its prompt and one token: max_new_tokens 1, no grammar",
            self.max_new_tokens,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0


def _require(condition: bool, rule: str, value) -> None:
    if not condition:
        raise ValueError(f"{rule}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
