"""Speculative decoding: a cheap proposer drafts tokens, the target model verifies them all in one
forward, and the verification keeps the target's output distribution unchanged."""

from infer.engine.spec_decode.rejection import accept_greedy, rejection_sample

__all__ = ["accept_greedy", "rejection_sample"]
