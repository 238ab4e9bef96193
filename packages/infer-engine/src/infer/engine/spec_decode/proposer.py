"""The proposer a SpeculativeConfig gives the scheduler."""

from infer.engine.spec_decode.config import SpeculativeConfig
from infer.engine.spec_decode.ngram import NgramProposer


def proposer_for(speculative: SpeculativeConfig | None) -> NgramProposer | None:
    """The scheduler's own proposer: n-gram lookup on the host. None when speculation is off,
    and for a draft model, which runs in the runner and hands its drafts back with each step's
    tokens (infer.engine.spec_decode.draft_model)."""
    if speculative is None or speculative.method != "ngram":
        return None
    return NgramProposer(
        speculative.num_speculative_tokens, speculative.prompt_lookup_min, speculative.prompt_lookup_max
    )
