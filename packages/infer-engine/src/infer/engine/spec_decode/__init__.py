"""Speculative decoding: proposers of draft tokens that the target model verifies in one forward."""

from infer.engine.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
