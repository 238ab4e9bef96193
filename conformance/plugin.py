"""The pytest plugin that turns every specs/*/*.yaml clause into tests and prints a clause table.

For each clause x case x implementation it yields one `ClauseItem`, named like
`ALLOC-001[PagedKVPool]`, `PAR-001[smollm2-fp32-cpu]` or `ALLOC-001[one-block-PagedKVPool]`,
that calls `check(case, impl)` from conformance/<contract>/checks.py. Planned clauses are
collected and skipped with "planned: waits for ...", so the table shows what is still owed.

The items hang under conformance/test_specs.py, so `pytest conformance` and a plain `pytest`
from the repository root each collect them exactly once. conformance/conftest.py activates the
hooks below; the plugin's own tests load it with `-p conformance.plugin` on a scratch folder.
"""

import copy
import inspect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.spec import Clause, Spec, SpecError, display_path, load_specs, resolve_check

CHECKS_DIR = Path(__file__).resolve().parent
ENTRY_MODULE = "test_specs.py"
# Contracts whose planned clauses run anyway once the user names a target for them: with
# --base-url, the api clauses no longer wait for our HTTP server, they test the given one.
TARGET_OPTION = {"api": "base_url"}


@dataclass(frozen=True)
class RunOptions:
    """What the command line says about the systems under test; checks that take an `options`
    parameter receive it (the api checks read the server address from it)."""

    base_url: str | None
    model: str | None
    api_key: str | None
    skip_planned: bool = False


# A clause item's user property: (collection order, clause id, says, waits_for). Reports carry
# their item's user properties, from pytest-xdist's workers to the process that prints the table.
CLAUSE_PROPERTY = "conformance_clause"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "spec-driven conformance suites (specs/, conformance/)")
    group.addoption(
        "--base-url",
        default=None,
        help="run the api contract against this OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 "
        "(its planned clauses then run too)",
    )
    group.addoption(
        "--model", default=None, help="model name for the api requests (default: the first of /models)"
    )
    group.addoption("--api-key", default=None, help="bearer token for --base-url (default: none)")
    group.addoption(
        "--contract", default=None, help="collect only this contract's clauses (e.g. api; default: all)"
    )
    group.addoption(
        "--skip-planned",
        action="store_true",
        help="keep planned clauses skipped even with --base-url (the server there is an `infer serve`, "
        "which does not have their features yet)",
    )
    group.addoption(
        "--specs-dir", default=None, type=Path, help="folder of <contract>/*.yaml (default: specs/)"
    )
    group.addoption(
        "--checks-dir", default=None, type=Path, help="folder of <contract>/checks.py (default: conformance/)"
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("conformance-clause-table"):
        config.pluginmanager.register(ClauseTable(), "conformance-clause-table")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With --contract only that contract's clauses are collected: the plugin's and the checks'
    own tests (conformance/tests) are no clauses (in `nox -s tests`' second api run they took
    longer than the clauses)."""
    if (
        config.getoption("contract") is not None
        and collection_path.resolve() == _checks_dir(config) / "tests"
    ):
        return True
    return None


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    if module_path.resolve() == _checks_dir(parent.config) / ENTRY_MODULE:
        return SpecSuite.from_parent(parent, path=module_path)
    return None


class SpecSuite(pytest.File):
    """All spec files at once: clause ids must be unique across them."""

    def collect(self):
        config = self.config
        checks_dir = _checks_dir(config)
        specs_dir = config.getoption("specs_dir") or checks_dir.parent / "specs"
        known_marks = [line.split(":")[0].strip() for line in config.getini("markers")]
        specs = load_specs(Path(specs_dir), checks_dir, known_marks)
        options = RunOptions(
            base_url=config.getoption("base_url"),
            model=config.getoption("model"),
            api_key=config.getoption("api_key"),
            skip_planned=config.getoption("skip_planned"),
        )
        contract = config.getoption("contract")
        clauses = [(spec, clause) for spec in specs for clause in spec.clauses]
        for order, (spec, clause) in enumerate(clauses):
            if contract is None or spec.contract == contract:
                yield from self._items(spec, clause, order, checks_dir, options)

    def _items(self, spec: Spec, clause: Clause, order: int, checks_dir: Path, options: RunOptions):
        target = TARGET_OPTION.get(spec.contract)
        targeted = target is not None and bool(getattr(options, target)) and not options.skip_planned
        # Checks of planned clauses are imported only when they may run.
        check = (
            resolve_check(checks_dir, clause) if clause.check and (targeted or not clause.planned) else None
        )
        runs = not clause.planned or (targeted and check is not None)
        for test_id, case, impl in spec.instances(clause):
            item = ClauseItem.from_parent(
                self, name=test_id, clause=clause, case=case, impl=impl, check=check, options=options
            )
            if not runs:
                item.add_marker(pytest.mark.skip(reason=f"planned: waits for {clause.waits_for}"))
            for mark in clause.marks:
                item.add_marker(getattr(pytest.mark, mark))
            item.user_properties.append((CLAUSE_PROPERTY, (order, clause.id, clause.says, clause.waits_for)))
            yield item

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, SpecError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


class ClauseItem(pytest.Item):
    """One clause on one case and one implementation."""

    def __init__(self, *, clause: Clause, case: dict, impl: str | None, check, options: RunOptions, **kwargs):
        super().__init__(**kwargs)
        self.clause = clause
        self.case = case
        self.impl = impl
        self.check = check
        self.options = options

    def runtest(self) -> None:
        wants_options = "options" in inspect.signature(self.check).parameters
        extra = {"options": self.options} if wants_options else {}
        # A copy, so one check cannot change the case another test receives.
        self.check(copy.deepcopy(self.case), self.impl, **extra)

    def _traceback_filter(self, excinfo):
        # Start the traceback at the check: the frames above it are this plugin and pluggy.
        traceback = excinfo.traceback
        from_check = traceback.cut(path=Path(inspect.getfile(self.check)))
        return (from_check if len(from_check) else traceback).filter(excinfo)

    def repr_failure(self, excinfo, style=None):
        where = f"{display_path(self.clause.path)}:{self.clause.line + 1}"
        header = f"{self.clause.id} ({where}): {self.clause.says}\n"
        return header + str(super().repr_failure(excinfo, style=style))

    def reportinfo(self):
        return self.clause.path, self.clause.line, f"{self.name}: {self.clause.says}"


class ClauseTable:
    """Collects every clause test's outcomes from the reports (setup, call and teardown alike) and
    prints them folded per clause at the end of the run. Reading reports, not items, it sees the
    tests that pytest-xdist's workers ran as well as its own."""

    def __init__(self) -> None:
        self.outcomes: dict[str, list[str]] = defaultdict(list)  # node id -> phase outcomes
        self.clause_of: dict[str, tuple] = {}  # node id -> (order, id, says, waits_for)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        clause = dict(report.user_properties).get(CLAUSE_PROPERTY)
        if clause is None:
            return
        outcome = report.outcome
        if outcome == "skipped" and _skip_reason(report).startswith("planned:"):
            outcome = "planned"
        self.clause_of[report.nodeid] = tuple(clause)
        self.outcomes[report.nodeid].append(outcome)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        per_clause: dict[tuple, list[str]] = defaultdict(list)
        for nodeid, outcomes in self.outcomes.items():
            per_clause[self.clause_of[nodeid]].append(_fold(outcomes))
        if not per_clause:
            return
        rows = [
            (clause, _clause_result(tests), _count(tests)) for clause, tests in sorted(per_clause.items())
        ]
        width_id = max(len(clause[1]) for clause, _, _ in rows)
        totals = defaultdict(int)
        terminalreporter.write_sep("=", "conformance clauses")
        for (_, clause_id, says, waits_for), result, count in rows:
            totals[result] += 1
            statement = says if result != "planned" else f"{says} (waits for {waits_for})"
            line = f"{clause_id:<{width_id}}  {result:<7}  {count:>5}  {statement}"
            terminalreporter.write_line(line, red=result == "fail")
        summary = ", ".join(f"{n} {name}" for name, n in sorted(totals.items()))
        terminalreporter.write_line(f"{len(rows)} clauses: {summary}")


def _fold(outcomes: list[str]) -> str:
    """setup/call/teardown outcomes of one test -> one of pass, fail, skip, planned."""
    if "failed" in outcomes:
        return "fail"
    if "planned" in outcomes:
        return "planned"
    if "skipped" in outcomes:
        return "skip"
    return "pass"


def _clause_result(test_results: list[str]) -> str:
    for result in ("fail", "planned"):
        if result in test_results:
            return result
    return "pass" if "pass" in test_results else "skip"


def _count(test_results: list[str]) -> str:
    """passed/run tests of a clause, e.g. 3/4 (blank for planned clauses)."""
    if "planned" in test_results:
        return ""
    return f"{test_results.count('pass')}/{len(test_results)}"


def _skip_reason(report: pytest.TestReport) -> str:
    # A skip's longrepr is (path, line, "Skipped: reason").
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    return ""


def _checks_dir(config: pytest.Config) -> Path:
    chosen = config.getoption("checks_dir")
    return Path(chosen).resolve() if chosen else CHECKS_DIR
