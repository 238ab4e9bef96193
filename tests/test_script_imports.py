"""The repository's scripts (kernels-bench/, experiments/) import only names that infer has.

No test runs them on the CPU (most need a GPU), so a rename in the packages can leave one broken
until someone runs it: kernels-bench/gguf_gemv_cpu_variants.py imported a private function that
096da50 had folded into `native_function`. Read with `ast`; only the infer modules they name are
imported.
"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "kernels-bench").glob("*.py")) + sorted((ROOT / "experiments").glob("*.py"))


def infer_imports(script: Path) -> list[tuple[str, str]]:
    """(module, name) for each `from infer... import name` in `script`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(script.read_text(), filename=str(script))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("infer"):
            found += [(node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_infer_name_a_script_imports_exists(script):
    missing = []
    for module_name, name in infer_imports(script):
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")  # a submodule, not yet imported
            except ModuleNotFoundError:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"{script.name} imports what infer does not have: {missing}"
