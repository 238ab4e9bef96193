"""`SpeculativeConfig`: what `--speculative-config` says, as vLLM spells it.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "PATH_OR_ALIAS", "num_speculative_tokens": 4}

EngineConfig.speculative_config holds the mapping as given (so that a config file round-trips);
`SpeculativeConfig.from_dict` validates it, naming the key that breaks a rule.
"""

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
DEFAULT_MIN_ACCEPTANCE_RATE = {"ngram": 0.0, "draft_model": 0.3}


class SpeculativeConfigError(ValueError):
    """A speculative_config key or value the engine cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # Draft tokens proposed per request per step (K): a verified row runs K + 1 tokens.
    num_speculative_tokens: int
    # ngram: the shortest and longest suffix n-gram looked up in the request's own tokens. vLLM's
    # defaults: one given sets the other; neither given, both 5.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: an alias or checkpoint folder sharing the target's vocabulary.
    model: str | None = None
    # No request speculates in a step with more running requests than this (vLLM's key): at
    # large batches a step is compute-bound and verifying K tokens costs more than it saves.
    disable_by_batch_size: int | None = None
    # Our key: the share of draft tokens kept below which the scheduler speculates on ever fewer
    # steps (infer.engine.spec_decode.backoff); 0 turns the back-off off. Not given: 0.3 for a
    # draft model, each of whose drafts costs a forward of the draft; 0 for ngram, whose
    # proposals cost no forward and come only where the text repeats itself (a back-off there
    # sat out the copying that followed a few failed lookups).
    min_acceptance_rate: float | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(values, dict):
            raise SpeculativeConfigError(
                f"speculative_config must be a mapping such as "
                f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {type(values).__name__}'
            )
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"unknown keys {unknown} in speculative_config; known keys: {sorted(known)}"
            )
        for required in ("method", "num_speculative_tokens"):
            if values.get(required) is None:
                raise SpeculativeConfigError(f"speculative_config.{required} is required")
        config = dict(values)
        if config["method"] == "ngram":
            low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
            config["prompt_lookup_min"] = low if low is not None else (high if high is not None else 5)
            config["prompt_lookup_max"] = high if high is not None else config["prompt_lookup_min"]
        return cls(**config)

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        if self.min_acceptance_rate is None:
            object.__setattr__(self, "min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE[self.method])
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise SpeculativeConfigError(
                f"speculative_config.min_acceptance_rate must be a number in [0, 1), got {rate!r}"
            )
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, minimum=1)
        if self.method == "ngram":
            _check_int("prompt_lookup_min", self.prompt_lookup_min, minimum=1)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, minimum=1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise SpeculativeConfigError(
                    f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                    f"prompt_lookup_max ({self.prompt_lookup_max})"
                )
            if self.model is not None:
                raise SpeculativeConfigError(
                    'speculative_config.model is for method "draft_model"; "ngram" needs no model'
                )
        else:
            if not isinstance(self.model, str) or not self.model:
                raise SpeculativeConfigError(
                    "speculative_config.model (an alias or checkpoint folder) is required by "
                    'method "draft_model"'
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise SpeculativeConfigError(f'speculative_config.{name} is for method "ngram"')


def _check_int(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpeculativeConfigError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < minimum:
        raise SpeculativeConfigError(f"speculative_config.{name} must be >= {minimum}, got {value}")
