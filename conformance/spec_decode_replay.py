"""What n-gram speculation must have counted for one greedy request that decoded alone, replayed
from its prompt and its tokens: the proposer's draft at each step and the run of it that the
target's own greedy tokens confirm. Independent of the scheduler's bookkeeping; it assumes the
scheduler's draft rule (up to K drafts, fewer where max_new_tokens leaves less room) and a
request that did not end inside an accepted run (ignore_eos, no stop)."""

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from infer.engine.spec_decode import NgramProposer


@dataclass(frozen=True)
class ReplayedCounts:
    # (drafts, accepted) of each step that verified drafts, in order.
    verdicts: tuple[tuple[int, int], ...]

    @property
    def num_verified_rows(self) -> int:
        return len(self.verdicts)

    @property
    def num_draft_tokens(self) -> int:
        return sum(drafts for drafts, _ in self.verdicts)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(accepted for _, accepted in self.verdicts)

    @property
    def drafted_by_position(self) -> tuple[int, ...]:
        counts = Counter(j for drafts, _ in self.verdicts for j in range(drafts))
        return tuple(counts[j] for j in range(len(counts)))

    @property
    def accepted_by_position(self) -> tuple[int, ...]:
        counts = Counter(j for _, accepted in self.verdicts for j in range(accepted))
        return tuple(counts[j] for j in range(len(counts)))

    def bench_figures(self, num_speculative_tokens: int) -> dict:
        """What the bench client must report for this run (infer.bench.spec_decode's figures),
        worked out here from the verdicts; ratios as pytest.approx."""
        rows, accepted = self.num_verified_rows, self.num_accepted_tokens
        by_position = [*self.accepted_by_position]
        by_position += [0] * (num_speculative_tokens - len(by_position))
        return {
            "verified_rows": rows,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": accepted,
            "acceptance_rate": pytest.approx(accepted / self.num_draft_tokens),
            "mean_accepted_length": pytest.approx(1 + accepted / rows),
            "accepted_by_position": by_position,
            "acceptance_rate_by_position": pytest.approx([count / rows for count in by_position]),
        }

    def tokens_per_step(self, num_output_tokens: int) -> list[int]:
        """Tokens each step emitted, sorted: the prefill's one, a verdict's accepted drafts and
        the target's one, and one for each step that had no draft."""
        verified = [accepted + 1 for _, accepted in self.verdicts]
        return sorted([1] * (num_output_tokens - sum(verified)) + verified)


def replay_ngram(
    speculative_config: dict, prompt: list[int], output: list[int], max_new_tokens: int
) -> ReplayedCounts:
    """`speculative_config`: the engine's (method "ngram"); `output`: the request's greedy tokens."""
    proposer = NgramProposer(
        speculative_config["num_speculative_tokens"],
        speculative_config["prompt_lookup_min"],
        speculative_config["prompt_lookup_max"],
    )
    verdicts, known = [], 1  # the first token comes from the prefill
    while known < len(output):
        room = max_new_tokens - known - 1
        drafts = proposer.propose(np.asarray(prompt + output[:known], dtype=np.int64))[:room] if room else []
        accepted = 0
        while accepted < len(drafts) and known + accepted < len(output):
            if drafts[accepted] != output[known + accepted]:
                break
            accepted += 1
        if drafts:
            verdicts.append((len(drafts), accepted))
        known += accepted + 1
    return ReplayedCounts(tuple(verdicts))
