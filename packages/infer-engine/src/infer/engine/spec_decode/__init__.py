"""Speculative decoding: a proposer drafts K tokens per request, the target verifies them in the
step's one forward, and the verification keeps the output distribution the target's own."""

from infer.engine.spec_decode.backoff import SpeculationBackoff
from infer.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from infer.engine.spec_decode.counts import SpecDecodeCounts
from infer.engine.spec_decode.ngram import NgramProposer
from infer.engine.spec_decode.proposer import proposer_for
from infer.engine.spec_decode.rejection import accept_greedy, rejection_sample

__all__ = [
    "NgramProposer",
    "SpecDecodeCounts",
    "SpeculationBackoff",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "accept_greedy",
    "proposer_for",
    "rejection_sample",
]
