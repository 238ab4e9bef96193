"""The spec plugin on a scratch spec folder, run in a child pytest as a user would run it."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conformance.spec import load_specs

REPO = Path(__file__).resolve().parents[2]

DEMO_CHECKS = """
def merged_case_and_impl(case, impl):
    # The plugin must merge defaults under the case and pass one name of applies_to.
    assert case == {"id": "small", "size": 2, "speed": "slow"}, case
    assert impl in ("ImplA", "ImplB"), impl

def always_fails(case, impl):
    raise AssertionError(f"deliberate failure for {impl}")

def sees_the_target(case, impl, options):
    assert options.base_url == "http://example.invalid/v1", options
"""

DEMO_SPEC = """
contract: demo
summary: A passing, a failing and a planned clause.
applies_to: [ImplA, ImplB]
defaults: {size: 1, speed: slow}
clauses:
  - id: DEMO-001
    status: required
    says: defaults merge under the case
    check: merged_case_and_impl
    cases: [{id: small, size: 2}]
  - id: DEMO-002
    status: required
    says: this clause always fails
    check: always_fails
  - id: DEMO-003
    status: planned
    waits_for: the flux capacitor
    says: not written yet
"""


def write_suite(root: Path, specs: dict[str, str], checks: dict[str, str]) -> None:
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    (root / "checks").mkdir()
    (root / "checks" / "test_specs.py").write_text("")
    for relative, text in specs.items():
        (root / "specs" / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / "specs" / relative).write_text(textwrap.dedent(text))
    for contract, text in checks.items():
        (root / "checks" / contract).mkdir()
        (root / "checks" / contract / "checks.py").write_text(textwrap.dedent(text))


def run_suite(root: Path, *args: str) -> subprocess.CompletedProcess:
    # No installed plugin but those named: a child then starts in half a second instead of three
    # and a half (langsmith's alone takes 1.7 s to import); xdist where the run asks for workers.
    plugins = ["-p", "conformance.plugin", "-p", "no:cacheprovider"]
    if "-n" in args:
        plugins += ["-p", "xdist.plugin"]
    command = [sys.executable, "-m", "pytest", *plugins, "--checks-dir", "checks", "-rs", "checks", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_pass_fail_and_planned_clauses(tmp_path):
    write_suite(tmp_path, {"demo/demo.yaml": DEMO_SPEC}, {"demo": DEMO_CHECKS})
    result = run_suite(tmp_path, "-v")
    out = result.stdout
    assert result.returncode == 1, out  # a failing required clause fails the run
    assert "DEMO-001[small-ImplA] PASSED" in out and "DEMO-001[small-ImplB] PASSED" in out
    assert "DEMO-002[ImplA] FAILED" in out
    assert "DEMO-003[ImplB] SKIPPED" in out
    assert "specs/demo/demo.yaml: planned: waits for the flux capacitor" in out
    assert "DEMO-002 (specs/demo/demo.yaml:12): this clause always fails" in out
    assert 'raise AssertionError(f"deliberate failure for {impl}")' in out
    table = out.split("conformance clauses")[1]
    assert "DEMO-001  pass       2/2  defaults merge under the case" in table
    assert "DEMO-002  fail       0/2  this clause always fails" in table
    assert "DEMO-003  planned         not written yet (waits for the flux capacitor)" in table


def test_the_clause_table_counts_the_tests_of_pytest_xdist_workers(tmp_path):
    # `nox -s tests` runs on two workers: the table must fold what they ran, not what the
    # process printing it ran (nothing).
    write_suite(tmp_path, {"demo/demo.yaml": DEMO_SPEC}, {"demo": DEMO_CHECKS})
    out = run_suite(tmp_path, "-n", "2").stdout
    table = out.split("conformance clauses")[1]
    assert "DEMO-001  pass       2/2  defaults merge under the case" in table
    assert "DEMO-002  fail       0/2  this clause always fails" in table
    assert "DEMO-003  planned         not written yet (waits for the flux capacitor)" in table
    assert "3 clauses: 1 fail, 1 pass, 1 planned" in table


def test_contract_leaves_the_checks_own_tests_out(tmp_path):
    write_suite(tmp_path, {"demo/demo.yaml": DEMO_SPEC}, {"demo": DEMO_CHECKS})
    (tmp_path / "checks" / "tests").mkdir()
    (tmp_path / "checks" / "tests" / "test_own.py").write_text("def test_own_check():\n    pass\n")
    assert "test_own_check PASSED" in run_suite(tmp_path, "-v").stdout
    narrowed = run_suite(tmp_path, "-v", "--contract", "demo").stdout
    assert "test_own_check" not in narrowed
    assert "DEMO-001[small-ImplA] PASSED" in narrowed


def test_only_passing_and_planned_clauses_pass_the_run(tmp_path):
    write_suite(tmp_path, {"demo/demo.yaml": DEMO_SPEC}, {"demo": DEMO_CHECKS})
    result = run_suite(tmp_path, "-k", "not DEMO-002")
    assert result.returncode == 0, result.stdout
    assert "DEMO-002" not in result.stdout.split("conformance clauses")[1]


def test_broken_spec_is_a_collection_error_naming_file_and_clause(tmp_path):
    broken = """
    contract: demo
    summary: every mistake at once
    clauses:
      - id: DEMO-001
        status: required
        says: its check does not exist
        check: no_such_function
      - id: DEMO-001
        status: planned
        waits_for: nothing
        says: a duplicate id
      - id: DEMO-002
        status: required
        says: a typo in a key
        chek: merged_case_and_impl
      - id: DEMO-003
        status: planned
        says: planned without waits_for
    """
    write_suite(tmp_path, {"demo/broken.yaml": broken}, {"demo": DEMO_CHECKS})
    result = run_suite(tmp_path)
    out = result.stdout
    assert result.returncode == 2, out  # interrupted: errors during collection
    assert (
        "specs/demo/broken.yaml: DEMO-001: check 'no_such_function' is not a function in "
        "checks/demo/checks.py" in out
    )
    assert "specs/demo/broken.yaml: DEMO-001: duplicate clause id" in out
    assert "specs/demo/broken.yaml: DEMO-002: unknown keys ['chek']" in out
    assert "specs/demo/broken.yaml: DEMO-002: a required clause needs `check:" in out
    assert "specs/demo/broken.yaml: DEMO-003: a planned clause needs `waits_for:" in out


FORMAT_MISTAKES = {
    # file under specs/: (text, the message that must name it)
    "yaml/x.yaml": ("contract: yaml\nsummary: s\nclauses: [\n", "specs/yaml/x.yaml: not valid YAML"),
    "folder/x.yaml": (
        "contract: other\nsummary: s\nclauses: [{id: FOLD-001, status: planned, waits_for: x, says: y}]\n",
        "specs/folder/x.yaml: contract is 'other' but the file lies in specs/folder/",
    ),
    "ids/x.yaml": (
        "contract: ids\nsummary: s\nclauses: [{id: ids-1, status: planned, waits_for: x, says: y}]\n",
        "specs/ids/x.yaml: ids-1: id must look like ALLOC-001",
    ),
    "status/x.yaml": (
        "contract: status\nsummary: s\nclauses: [{id: STAT-001, status: done, says: y}]\n",
        "specs/status/x.yaml: STAT-001: status must be one of ['required', 'planned'], got 'done'",
    ),
    "cases/x.yaml": (
        "contract: cases\nsummary: s\nclauses: [{id: CASE-001, status: planned, waits_for: x, says: y, "
        "cases: [{n: 1}]}]\n",
        "specs/cases/x.yaml: CASE-001: every case needs an id",
    ),
    "marks/x.yaml": (
        "contract: marks\nsummary: s\nclauses: [{id: MARK-001, status: planned, waits_for: x, says: y, "
        "marks: [fast]}]\n",
        "specs/marks/x.yaml: MARK-001: unknown marks ['fast']",
    ),
    "missing/x.yaml": (
        "contract: missing\nsummary: s\nclauses: [{id: MISS-001, status: required, says: y, check: f}]\n",
        "specs/missing/x.yaml: MISS-001: required, but checks/missing/checks.py does not exist",
    ),
}


def test_every_format_rule_names_file_and_clause(tmp_path):
    write_suite(tmp_path, {path: text for path, (text, _) in FORMAT_MISTAKES.items()}, {})
    result = run_suite(tmp_path)
    assert result.returncode == 2, result.stdout
    missing = [message for _, message in FORMAT_MISTAKES.values() if message not in result.stdout]
    assert not missing, result.stdout


def test_base_url_runs_the_planned_api_clauses_against_that_server(tmp_path):
    api_spec = """
    contract: api
    summary: the target option turns planned api clauses on
    clauses:
      - id: API-001
        status: planned
        waits_for: HTTP server
        says: the check sees --base-url
        check: sees_the_target
    """
    write_suite(tmp_path, {"api/x.yaml": api_spec}, {"api": DEMO_CHECKS})
    assert "planned: waits for HTTP server" in run_suite(tmp_path).stdout
    result = run_suite(tmp_path, "--base-url", "http://example.invalid/v1")
    assert result.returncode == 0, result.stdout
    assert "API-001  pass       1/1" in result.stdout


def test_repository_suites_are_collected_exactly_once():
    # The anchor module sits under testpaths, so a plain `pytest` from the root must yield each
    # clause test once: as many items as the spec files define, `gpu` ones included (collected,
    # then skipped without CUDA). (packages/ is left out of testpaths only to keep this fast:
    # nothing under it collects specs. `--ignore` would not do: pytest collects a testpath whole.)
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-o", "testpaths=tests conformance"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    collected = [line.split("::", 1)[1] for line in out.splitlines() if "test_specs.py::" in line]
    specs = load_specs(REPO / "specs", REPO / "conformance", known_marks=["slow", "gpu"])
    defined = [
        test_id for spec in specs for clause in spec.clauses for test_id, _, _ in spec.instances(clause)
    ]
    assert sorted(collected) == sorted(defined), out[-2000:]
