"""When drafts keep failing, speculate on fewer steps: the scheduler's automatic back-off.

A rejected draft costs what proposing and verifying it took: nothing on the host for the n-gram
proposer but K extra tokens in the target's forward, and K forwards of the draft model for a
draft model. With drafts that are almost never right (a draft model unlike its target, text
with nothing to look up) that cost is all there is, so the scheduler watches the share of draft
tokens the target keeps and, while it stays under `min_acceptance_rate`, speculates only on
every 8th, 64th, ... up to every MAX_INTERVAL-th step, and there for PROBE_ROWS requests only.
Those probes keep the estimate current: one that keeps enough of its drafts brings speculation
back on every step, for every request. Until the first verdict, steps are probes too: an
engine that starts with a full batch does not draft for all of it to learn the draft is bad.

The gate is the batch's, not each request's: a draft model's K forwards cost about as much for
one row as for many, so probes pay least when the rows probe in the same steps (the multiples
of the interval), and a few rows tell whether the draft has turned useful as well as all of
them would, without the catch-up forwards and K + 1 verified tokens of every row.
"""

# Longest run of steps without speculation, and its growth after each failing probe: a probe
# costs several steps' time, and spacing them 4-fold up to 128 cost a failing draft model 1.4-5%
# on the H200 against 0.5-2.4% for 8-fold up to 512 (docs/benchmarks/speculative.md#automatic-back-off);
# a draft that turns useful is found within 512 steps.
MAX_INTERVAL = 512
GROWTH = 8
# Requests that verify drafts in a probe step.
PROBE_ROWS = 2
# Weight of the newest verified step in the acceptance estimate (the first step's rate starts
# it): one good probe after a long back-off turns speculation back on.
NEWEST_WEIGHT = 0.5


class SpeculationBackoff:
    def __init__(self, min_acceptance_rate: float):
        """`min_acceptance_rate`: the share of draft tokens kept below which speculation backs
        off; 0 speculates on every step."""
        self.min_acceptance_rate = min_acceptance_rate
        self.acceptance_rate: float | None = None  # none measured yet
        self.interval = 1

    def rows(self, step: int) -> int | None:
        """How many requests may verify drafts in step number `step`: None for every one."""
        if self.interval == 1:
            waiting = self.acceptance_rate is None and self.min_acceptance_rate > 0
            return PROBE_ROWS if waiting else None
        return PROBE_ROWS if step % self.interval == 0 else 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One step's verdicts: the draft tokens it verified and those the target kept."""
        if num_draft_tokens == 0 or self.min_acceptance_rate <= 0:
            return
        step_rate = num_accepted_tokens / num_draft_tokens
        previous = step_rate if self.acceptance_rate is None else self.acceptance_rate
        self.acceptance_rate = NEWEST_WEIGHT * step_rate + (1 - NEWEST_WEIGHT) * previous
        if self.acceptance_rate < self.min_acceptance_rate:
            self.interval = min(GROWTH * self.interval, MAX_INTERVAL)
        else:
            self.interval = 1
