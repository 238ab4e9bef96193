"""How the contracts' hypothesis state machines run (specs/allocator, specs/prefix_cache), and what
conformance/tests reads from a broken implementation's run."""

from collections.abc import Callable, Iterable

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


def failure_messages(check: Callable, case: dict, impl: str, says: Iterable[str]) -> list[str]:
    """The AssertionErrors `check(case, impl)` raises, for conformance/tests' broken
    implementations (hypothesis groups them when it finds several bugs). First from the first
    failing example found, unshrunk; when none of those says any of `says`, again as the suite
    runs the check, shrunk to the smallest failure (an unshrunk example may trip over another
    error first): shrinking took most of those tests' time."""
    says = tuple(says)
    messages = _assertion_messages(check, {**case, "shrink": False}, impl)
    if any(fragment in message for fragment in says for message in messages):
        return messages
    return _assertion_messages(check, {**case, "shrink": True}, impl)


def _assertion_messages(check: Callable, case: dict, impl: str) -> list[str]:
    try:
        check(case, impl)
    except Exception as error:  # noqa: BLE001 - sorted below: only assertions are the check's verdict
        return [str(e) for e in getattr(error, "exceptions", [error]) if type(e) is AssertionError]
    return []
