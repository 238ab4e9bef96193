"""What speculation did, counted by the scheduler as verdicts come back: the figures behind
infer_spec_decode_* metrics and /v1/stats."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounts:
    # Draft tokens verified, and those the target accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Rows that verified drafts (each emits its accepted drafts and one token of the target's).
    num_verified_rows: int = 0
    # accepted_by_position[j]: verified rows whose draft j was accepted (j < K).
    accepted_by_position: list[int] = field(default_factory=list)
    # drafted_by_position[j]: verified rows that had a draft j.
    drafted_by_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verified_rows += 1
        for counts, upto in (
            (self.drafted_by_position, num_drafts),
            (self.accepted_by_position, num_accepted),
        ):
            if len(counts) < upto:
                counts.extend([0] * (upto - len(counts)))
            for position in range(upto):
                counts[position] += 1

    def engine_stats(self, num_speculative_tokens: int) -> dict:
        """These counts as EngineStats' spec_decode_* fields (tuples: plain data that pickles)."""
        return dict(
            spec_decode_num_speculative_tokens=num_speculative_tokens,
            spec_decode_num_verified_rows=self.num_verified_rows,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            spec_decode_accepted_by_position=tuple(self.accepted_by_position),
            spec_decode_drafted_by_position=tuple(self.drafted_by_position),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified row emitted on average: its accepted drafts plus the target's one."""
        if not self.num_verified_rows:
            return 0.0
        return 1 + self.num_accepted_tokens / self.num_verified_rows
