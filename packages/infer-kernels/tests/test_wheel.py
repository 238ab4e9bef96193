"""The infer-kernels wheel alone: built, installed into a bare venv, imported, and run on CPU.

Proves the package declares its dependencies (torch and triton only) and imports nothing from
the other infer packages. The venv has no system site-packages, so nothing leaks in from the
development environment; torch comes from the local CPU wheel, triton from the pip cache.
"""

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the local CPU build; any other spec pulls GBs of CUDA wheels

CHECK_INSTALLED = """
import importlib.metadata, importlib.util, re, torch
from infer.kernels import rms_norm, rms_norm_ref
x, w = torch.randn(4, 576), torch.randn(576)
expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w
torch.testing.assert_close(rms_norm(x, w, 1e-6), expected)
others = [
    n for n in ("models", "cache", "engine", "server", "bench") if importlib.util.find_spec("infer." + n)
]
assert not others, f"other infer packages are importable in the bare venv: {others}"
requires = sorted(re.match(r"[\\w.-]+", r).group() for r in importlib.metadata.requires("infer-kernels"))
assert requires == ["torch", "triton"], f"infer-kernels must depend on torch and triton only, got {requires}"
# The C kernels' sources ship beside their loader, and build from the installed wheel where they can.
import pathlib, shutil
from infer.kernels import native_cpu_kernels_available
from infer.kernels.cpu import native
missing = [s for s in native.SOURCES if not (pathlib.Path(native.__file__).parent / s).is_file()]
assert not missing, f"the wheel lacks the C sources {missing}"
if shutil.which("cc") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
    assert native_cpu_kernels_available(), "the C kernels do not build from the installed wheel"
print("ok")
"""


def run(*args: str | Path) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True)


@pytest.mark.slow
def test_wheel_installs_and_runs_alone(tmp_path):
    wheel_dir = tmp_path / "dist"
    # Build with this environment's setuptools when it has one: no index needed, and faster.
    no_isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    # setuptools writes build/ and *.egg-info next to the sources: build from a copy.
    source = shutil.copytree(
        PACKAGE_DIR, tmp_path / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", *no_isolation, "-w", wheel_dir, source)
    (wheel,) = wheel_dir.glob("infer_kernels-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    # --no-compile: byte-compiling torch's and triton's thousands of files tests nothing here.
    run(python, "-m", "pip", "install", "-q", "--no-compile", TORCH)
    triton = f"triton=={importlib.metadata.version('triton')}"
    run(python, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", wheel, triton)

    result = subprocess.run(
        [str(python), "-c", CHECK_INSTALLED],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
