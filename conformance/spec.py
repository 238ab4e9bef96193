"""Reads specs/<contract>/*.yaml into Spec and Clause objects, and rejects malformed files.

The format (docs/conformance.md has the prose):

    contract: allocator            # = the folder name; checks live in conformance/<contract>/checks.py
    summary: one paragraph
    applies_to: [PagedKVPool]      # optional: implementation names the checks resolve
    defaults: {}                   # optional: merged under every case
    clauses:
      - id: ALLOC-001
        status: required           # or planned, with waits_for: "paged KV pool"
        says: free + used always equals the capacity
        check: conservation        # a function check(case, impl) in checks.py
        cases: [{id: small, ...}]  # optional; every case needs an id
        marks: [slow]              # optional pytest markers for every test of the clause

Every problem found is reported at once, each naming the file, the clause, the rule and the fix.
"""

import importlib.util
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

SPEC_KEYS = {"contract", "summary", "applies_to", "defaults", "clauses"}
REQUIRED_SPEC_KEYS = {"contract", "summary", "clauses"}
CLAUSE_KEYS = {"id", "status", "says", "check", "waits_for", "cases", "marks"}
REQUIRED_CLAUSE_KEYS = {"id", "status", "says"}
STATUSES = ("required", "planned")
CLAUSE_ID = re.compile(r"^[A-Z][A-Z0-9]*-\d{3}$")
# Case ids and implementation names become part of test ids: keep them shell- and -k-friendly.
NAME = re.compile(r"^[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*$")


class SpecError(Exception):
    """One or more spec files break the format; the message lists every problem."""


@dataclass(frozen=True)
class Clause:
    id: str
    status: str
    says: str
    check: str | None
    waits_for: str | None
    cases: tuple[dict[str, Any], ...]
    marks: tuple[str, ...]
    contract: str
    path: Path
    line: int  # 0-based line of the clause's id in the file, for reports

    @property
    def planned(self) -> bool:
        return self.status == "planned"


@dataclass(frozen=True)
class Spec:
    path: Path
    contract: str
    summary: str
    applies_to: tuple[str, ...]
    defaults: dict[str, Any]
    clauses: tuple[Clause, ...] = field(default=())

    def instances(self, clause: Clause) -> list[tuple[str, dict[str, Any], str | None]]:
        """(test id, case, impl) for every case x implementation of `clause`, in file order."""
        cases = [{**self.defaults, **case} for case in clause.cases] or [dict(self.defaults)]
        impls: list[str | None] = list(self.applies_to) or [None]
        out = []
        for case in cases:
            for impl in impls:
                parts = [p for p in (case.get("id"), impl) if p is not None]
                test_id = f"{clause.id}[{'-'.join(parts)}]" if parts else clause.id
                out.append((test_id, case, impl))
        return out


def load_specs(specs_dir: Path, checks_dir: Path, known_marks: Iterable[str]) -> list[Spec]:
    """Every specs_dir/*/*.yaml, validated; raises SpecError listing all problems."""
    problems: list[str] = []
    specs = []
    for path in sorted(specs_dir.glob("*/*.yaml")):
        spec = _parse_spec(path, set(known_marks), problems)
        if spec is not None:
            specs.append(spec)
    _check_unique_ids(specs, problems)
    for spec in specs:
        _check_functions_exist(spec, checks_dir, problems)
    if problems:
        raise SpecError("invalid spec files:\n" + "\n".join(f"  - {p}" for p in problems))
    return specs


def resolve_check(checks_dir: Path, clause: Clause) -> Callable[..., None] | None:
    """The clause's check function, or None when its checks.py or the function is missing."""
    module = load_checks_module(checks_dir, clause.contract)
    if module is None or clause.check is None:
        return None
    function = getattr(module, clause.check, None)
    return function if callable(function) else None


_MODULES: dict[Path, ModuleType | None] = {}


def load_checks_module(checks_dir: Path, contract: str) -> ModuleType | None:
    """checks_dir/<contract>/checks.py, imported once by path (None if the file is absent).

    Imported by path, not by package name, so that the plugin's own tests can point it at a
    scratch folder; checks modules use absolute imports (`from conformance.x import y`).
    """
    path = (checks_dir / contract / "checks.py").resolve()
    if path not in _MODULES:
        if not path.exists():
            _MODULES[path] = None
        else:
            name = f"_conformance_checks_{contract.replace('-', '_')}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            _MODULES[path] = module
    return _MODULES[path]


def _parse_spec(path: Path, known_marks: set[str], problems: list[str]) -> Spec | None:
    where = display_path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        problems.append(f"{where}: not valid YAML: {error}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{where}: the top level must be a mapping with keys {sorted(REQUIRED_SPEC_KEYS)}")
        return None
    _check_keys(data, SPEC_KEYS, REQUIRED_SPEC_KEYS, where, problems)
    contract = data.get("contract")
    if contract != path.parent.name:
        problems.append(
            f"{where}: contract is {contract!r} but the file lies in specs/{path.parent.name}/; "
            f"set `contract: {path.parent.name}` or move the file"
        )
    applies_to = data.get("applies_to", [])
    if not isinstance(applies_to, list) or not all(isinstance(n, str) and NAME.match(n) for n in applies_to):
        problems.append(f"{where}: applies_to must be a list of implementation names, got {applies_to!r}")
    elif len(set(applies_to)) != len(applies_to):
        problems.append(f"{where}: applies_to names an implementation twice: {applies_to}")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        problems.append(f"{where}: defaults must be a mapping, got {defaults!r}")
    if not isinstance(data.get("summary", ""), str):
        problems.append(f"{where}: summary must be a string (one paragraph)")
    raw_clauses = data.get("clauses")
    if not isinstance(raw_clauses, list) or not raw_clauses:
        problems.append(f"{where}: clauses must be a non-empty list of mappings")
        raw_clauses = []
    lines = path.read_text().splitlines()
    clauses = [
        _parse_clause(raw, i, path, contract, known_marks, problems, lines)
        for i, raw in enumerate(raw_clauses)
    ]
    # Returned even when broken, so that ids and check names are still checked and every
    # problem is reported in one run; load_specs raises once it has them all.
    return Spec(
        path,
        contract,
        data.get("summary", ""),
        tuple(applies_to) if isinstance(applies_to, list) else (),
        defaults if isinstance(defaults, dict) else {},
        tuple(c for c in clauses if c is not None),
    )


def _parse_clause(
    raw: Any,
    index: int,
    path: Path,
    contract: str,
    known_marks: set[str],
    problems: list[str],
    lines: list[str],
) -> Clause | None:
    where = f"{display_path(path)}: clause #{index + 1}"
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a mapping with keys {sorted(REQUIRED_CLAUSE_KEYS)}, got {raw!r}")
        return None
    if "id" in raw:
        where = f"{display_path(path)}: {raw['id']}"
    _check_keys(raw, CLAUSE_KEYS, REQUIRED_CLAUSE_KEYS, where, problems)
    clause_id, status = raw.get("id"), raw.get("status")
    if not isinstance(clause_id, str) or not CLAUSE_ID.match(clause_id):
        problems.append(
            f"{where}: id must look like ALLOC-001 (letters, dash, three digits), got {clause_id!r}"
        )
    if status not in STATUSES:
        problems.append(f"{where}: status must be one of {list(STATUSES)}, got {status!r}")
    if status == "required" and not raw.get("check"):
        problems.append(f"{where}: a required clause needs `check: <function in checks.py>`")
    if status == "planned" and not isinstance(raw.get("waits_for"), str):
        problems.append(f"{where}: a planned clause needs `waits_for: <what it waits for>`")
    if status == "required" and "waits_for" in raw:
        problems.append(f"{where}: waits_for belongs to planned clauses; drop it or set status: planned")
    if not isinstance(raw.get("says", ""), str):
        problems.append(f"{where}: says must be one sentence (a string)")
    cases = raw.get("cases", [])
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
        problems.append(f"{where}: cases must be a list of mappings, each with an id")
        cases = []
    case_ids = [c.get("id") for c in cases]
    for case_id in case_ids:
        if not isinstance(case_id, str) or not NAME.match(case_id):
            problems.append(
                f"{where}: every case needs an id of letters, digits, '_', '.', '-'; got {case_id!r}"
            )
    duplicates = sorted({c for c in case_ids if isinstance(c, str) and case_ids.count(c) > 1})
    if duplicates:
        problems.append(f"{where}: duplicate case ids {duplicates}")
    marks = raw.get("marks", [])
    unknown = [m for m in marks if m not in known_marks] if isinstance(marks, list) else marks
    if unknown:
        problems.append(f"{where}: unknown marks {unknown}; use markers registered in pyproject.toml")
    return Clause(
        id=clause_id,
        status=status,
        says=raw.get("says", ""),
        check=raw.get("check"),
        waits_for=raw.get("waits_for"),
        cases=tuple(cases),
        marks=tuple(marks) if isinstance(marks, list) else (),
        contract=contract,
        path=path,
        line=next((n for n, text in enumerate(lines) if re.search(rf"\bid: *{clause_id}\b", text)), 0),
    )


def _check_keys(data: dict, allowed: set[str], required: set[str], where: str, problems: list[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        problems.append(f"{where}: unknown keys {unknown}; allowed keys are {sorted(allowed)}")
    missing = sorted(required - set(data))
    if missing:
        problems.append(f"{where}: missing keys {missing}")


def _check_unique_ids(specs: list[Spec], problems: list[str]) -> None:
    seen: dict[str, Path] = {}
    for spec in specs:
        for clause in spec.clauses:
            if clause.id in seen:
                problems.append(
                    f"{display_path(spec.path)}: {clause.id}: duplicate clause id, also in "
                    f"{display_path(seen[clause.id])}; give it the next free number"
                )
            seen.setdefault(clause.id, spec.path)


def _check_functions_exist(spec: Spec, checks_dir: Path, problems: list[str]) -> None:
    required = [c for c in spec.clauses if c.status == "required" and c.check]
    if not required:
        # Planned clauses need no checks.py, and importing one (heavy for some contracts) is wasted.
        return
    checks_path = checks_dir / spec.contract / "checks.py"
    try:
        module = load_checks_module(checks_dir, spec.contract)
    except Exception as error:  # noqa: BLE001 - any import failure is reported as a spec problem
        problems.append(f"{display_path(checks_path)}: importing it failed: {type(error).__name__}: {error}")
        return
    for clause in required:
        if module is None:
            problems.append(
                f"{display_path(spec.path)}: {clause.id}: required, but {display_path(checks_path)} "
                "does not exist; write it or mark the clause planned"
            )
        elif not callable(getattr(module, clause.check, None)):
            problems.append(
                f"{display_path(spec.path)}: {clause.id}: check {clause.check!r} is not a function in "
                f"{display_path(checks_path)}; define `def {clause.check}(case, impl)` there or fix the name"
            )


def display_path(path: Path) -> str:
    """`path` relative to the working directory when inside it, for messages."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
