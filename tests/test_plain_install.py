"""README's install without nox, run as written in a fresh virtualenv: `infer` is then on the
PATH of a shell that activated it, and answers `--help` and `serve --help`.

Slow: about 40 s on CI's two cores, most of it pip unpacking torch (from pip's cache, which the
nox session's own install has just filled; CI reaches only the package registry anyway).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_pip_install_args() -> list[str]:
    """The arguments of README's `$ pip install ... -e packages/infer-server` command."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")  # join continued lines
    found = re.findall(r"^\$ pip install (.*-e packages/infer-server.*)$", text, re.MULTILINE)
    assert len(found) == 1, f"README.md should hold one pip install of the packages, found {found}"
    return shlex.split(found[0])


@pytest.mark.slow
def test_readme_install_without_nox_puts_a_working_infer_on_path(tmp_path):
    venv = tmp_path / "venv"
    # Nothing of the environment running this test may leak into the new one.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    # --no-compile: byte-compiling torch's thousands of files costs CI ~10 s and tests nothing here.
    install = [str(venv / "bin" / "pip"), "install", "--quiet", "--no-compile", *readme_pip_install_args()]
    subprocess.run(install, cwd=REPO, check=True, env=env, timeout=600)

    # A user's shell: the system PATH, the virtualenv activated, outside the checkout.
    shell_env = {**env, "PATH": os.defpath}
    script = f". {shlex.quote(str(venv / 'bin' / 'activate'))} && command -v infer && infer --help"
    script += " && infer serve --help"
    ran = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=shell_env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, f"`{script}` failed:\n{ran.stdout}{ran.stderr}"
    found_at, *help_text = ran.stdout.splitlines()
    assert found_at == str(venv / "bin" / "infer")
    assert any(line.startswith("infer serve") for line in help_text)  # the command table of --help
    assert any("--max-batch-size" in line for line in help_text)  # serve --help: the engine's flags
