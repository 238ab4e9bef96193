"""The proposer a SpeculativeConfig asks for."""

from infer.engine.spec_decode.config import SpeculativeConfig
from infer.engine.spec_decode.ngram import NgramProposer


def proposer_for(speculative: SpeculativeConfig | None) -> NgramProposer | None:
    """The scheduler's proposer: n-gram lookup on the host; None when speculation is off."""
    if speculative is None:
        return None
    if speculative.method != "ngram":
        raise ValueError(f"no proposer for method {speculative.method!r} yet")
    return NgramProposer(
        speculative.num_speculative_tokens, speculative.prompt_lookup_min, speculative.prompt_lookup_max
    )
