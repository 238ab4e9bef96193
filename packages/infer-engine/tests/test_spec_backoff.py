"""The scheduler's speculation back-off (infer.engine.spec_decode.backoff), alone: fed verdicts,
which steps may speculate, and for how many requests."""

from infer.engine.spec_decode.backoff import GROWTH, MAX_INTERVAL, PROBE_ROWS, SpeculationBackoff


def speculating_steps(backoff: SpeculationBackoff, num_steps: int, kept, num_rows: int = 16) -> list[int]:
    """Runs `num_steps` steps of `num_rows` requests; in each that speculates, each request the
    back-off lets verify 4 drafts keeps kept(step) of them. Returns the steps that speculated."""
    steps = []
    for step in range(num_steps):
        rows = backoff.rows(step)
        rows = num_rows if rows is None else min(rows, num_rows)
        if rows:
            steps.append(step)
            backoff.record(4 * rows, kept(step) * rows)
    return steps


def test_failing_drafts_space_the_probes_out_to_every_512th_step_for_a_few_rows():
    backoff = SpeculationBackoff(0.3)
    assert backoff.rows(0) == PROBE_ROWS  # until the first verdict, a probe
    steps = speculating_steps(backoff, 3000, kept=lambda step: 0)
    gaps = [later - earlier for earlier, later in zip(steps, steps[1:], strict=False)]
    # The first failing step backs off; the gaps grow GROWTH-fold up to MAX_INTERVAL, then hold.
    assert GROWTH == 8 and MAX_INTERVAL == 512
    assert gaps[:3] == [8, 56, 448] and set(gaps[3:]) == {MAX_INTERVAL}
    assert backoff.rows(3072) == PROBE_ROWS and backoff.rows(3073) == 0


def test_drafts_kept_at_the_floor_speculate_on_every_step_for_every_request():
    backoff = SpeculationBackoff(0.3)
    assert speculating_steps(backoff, 200, kept=lambda step: 2) == list(range(200))
    assert backoff.rows(200) is None  # every request, once a verdict said so


def test_one_good_probe_brings_speculation_back_on_every_step():
    backoff = SpeculationBackoff(0.3)
    speculating_steps(backoff, 500, kept=lambda step: 0)
    assert backoff.interval == MAX_INTERVAL
    # The text turns copyable: the next probe keeps every draft.
    steps = speculating_steps(backoff, 640, kept=lambda step: 4)
    probe = steps[0]
    assert steps[1:] == list(range(probe + 1, 640))
    assert backoff.rows(640) is None


def test_a_floor_of_zero_never_backs_off():
    backoff = SpeculationBackoff(0)
    assert backoff.rows(0) is None
    assert speculating_steps(backoff, 300, kept=lambda step: 0) == list(range(300))
    assert backoff.rows(300) is None
