"""How the contracts' hypothesis state machines run (specs/allocator, specs/prefix_cache)."""

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test


def run_machine(machine: type, case: dict) -> None:
    """Runs `machine` for the case's `max_examples` examples of up to `steps` steps. A case with
    `"shrink": False` reports the first failing example as found: conformance/tests only asks
    whether a broken implementation fails, and shrinking its failure took most of their time."""
    phases = [
        phase for phase in Phase if case.get("shrink", True) or phase not in (Phase.shrink, Phase.explain)
    ]
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=case["max_examples"],
            stateful_step_count=case["steps"],
            deadline=None,
            phases=phases,
            # One failure per clause, the smallest found: a report names one bug, and runs stay short.
            report_multiple_bugs=False,
            # No example database: each run starts fresh, so examples saved while a deliberately
            # broken implementation failed (conformance/tests) never replay against another one.
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
