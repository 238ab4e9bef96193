"""Imports flow only down the package table, no two modules import each other (directly or
round a longer circle), and the six packages move as one version train.

    kernels <- models <- engine <- server <- bench;  cache <- engine

Read from the source with `ast` (nothing is imported), so a violation is caught even in a module
no test imports, or behind a function-level import.
"""

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parents[1] / "packages"
# Which other infer.* packages each may import (its own subpackages are always allowed).
MAY_IMPORT = {
    "kernels": set(),
    "models": {"kernels"},
    "cache": set(),
    "engine": {"models", "cache", "kernels"},
    "server": {"engine", "models", "cache", "kernels"},
    "bench": {"server", "engine", "models", "cache", "kernels"},
}
# The `infer` command (infer/server/cli.py) hands `bench` and `profile` to infer-bench by module
# name, when it is installed; nothing else in the library packages may even name it.
NAMES_BENCH = {"server/cli.py"}
# kernels ships alone as the core wheel: beside the standard library, torch and triton only.
KERNELS_THIRD_PARTY = {"torch", "triton"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative imports resolved."""
    src = next(parent for parent in path.parents if parent.name == "src")
    # The package a relative import starts from: infer.cache for infer/cache/kv_pool.py.
    package = list(path.relative_to(src).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return found


def source_files(name: str) -> list[Path]:
    return sorted((PACKAGES_DIR / f"infer-{name}" / "src" / "infer" / name).rglob("*.py"))


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_imports_flow_down(name):
    files = source_files(name)
    assert files, f"no sources under packages/infer-{name}/src/infer/{name}"
    allowed = MAY_IMPORT[name] | {name}
    violations = []
    for path in files:
        for line, module in imported_modules(path):
            parts = module.split(".")
            where = f"{path.relative_to(PACKAGES_DIR)}:{line}"
            if parts[0] == "infer":
                if len(parts) < 2 or parts[1] not in allowed:
                    violations.append(
                        f"{where} imports {module}; infer.{name} may import only {sorted(allowed)}"
                    )
            elif name == "kernels" and parts[0] not in KERNELS_THIRD_PARTY | sys.stdlib_module_names:
                violations.append(
                    f"{where} imports {module}; infer.kernels may use only torch, triton, stdlib"
                )
    assert not violations, "imports against the package table:\n" + "\n".join(violations)


def module_name(path: Path) -> str:
    src = next(parent for parent in path.parents if parent.name == "src")
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file imports when it runs, at module level or in a
    function; not those under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_checking_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    package = module_name(path).split(".")[: -1 if path.name != "__init__.py" else None]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                # `from infer.models import llama` imports the module infer.models.llama.
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return found & modules


def test_no_import_circles():
    """A circle (config imports registry, which imports the models, which import config) works
    only while a function-level import hides it, and breaks when someone moves that import up."""
    paths = {module_name(path): path for name in MAY_IMPORT for path in source_files(name)}
    graph = {module: runtime_imports(path, set(paths)) - {module} for module, path in paths.items()}

    def circle_through(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            module, trail = stack.pop()
            for imported in sorted(graph[module]):
                if imported == start:
                    return trail + [start]
                if imported not in seen:
                    seen.add(imported)
                    stack.append((imported, trail + [imported]))
        return None

    circles = {" -> ".join(circle) for module in sorted(graph) if (circle := circle_through(module))}
    assert not circles, "modules that import each other:\n" + "\n".join(sorted(circles))


@pytest.mark.parametrize("name", sorted(set(MAY_IMPORT) - {"bench"}))
def test_library_packages_do_not_name_infer_bench(name):
    """Catches what the import check cannot see: importlib.import_module("infer.bench...")."""
    root = PACKAGES_DIR / f"infer-{name}" / "src" / "infer"
    naming = {str(path.relative_to(root)) for path in source_files(name) if "infer.bench" in path.read_text()}
    assert naming <= NAMES_BENCH, f"infer.{name} names infer.bench in {sorted(naming - NAMES_BENCH)}"


def declared_versions(name: str) -> tuple[str, str]:
    """(__version__ in _version.py, version in pyproject.toml), read as text."""
    root = PACKAGES_DIR / f"infer-{name}"
    version_py = (root / "src" / "infer" / name / "_version.py").read_text()
    pyproject = (root / "pyproject.toml").read_text()
    return (
        re.search(r'^__version__ = "([^"]+)"', version_py, re.M).group(1),
        re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1),
    )


def test_every_package_exports_its_versions():
    for name in MAY_IMPORT:
        module = importlib.import_module(f"infer.{name}")
        assert isinstance(module.__version__, str), f"infer.{name} does not export __version__"
        assert isinstance(module.INTERFACE_VERSION, int) and module.INTERFACE_VERSION >= 1, (
            f"infer.{name}.INTERFACE_VERSION must be an int >= 1"
        )
        assert {"__version__", "INTERFACE_VERSION"} <= set(module.__all__), f"infer.{name}.__all__ lacks them"


def test_one_version_train():
    versions = {name: declared_versions(name) for name in MAY_IMPORT}
    train = {version for pair in versions.values() for version in pair}
    assert len(train) == 1, (
        f"the six packages must share one version (_version.py, pyproject.toml): {versions}"
    )
