"""`nox -s serve` runs `infer serve` in nox's place (tools/exec_command.py), so that a SIGTERM to
the process it started as reaches the server: it drains, exits 0 and frees its port for the next
start. Run here through the function the noxfile calls, on the default model, at the default log
level, whose output a user reads: a progress line with seconds for loading the weights, where it
listens once it answers, and no nanobind "leaked" lines at exit."""

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
# What the noxfile does, as a program: exec_command(the server's command, the environment).
LAUNCHER = (
    f"import os, sys; sys.path.insert(0, {str(TOOLS)!r}); from exec_command import exec_command; "
    "exec_command(sys.argv[1:], os.environ)"
)


@pytest.mark.slow
def test_sigterm_to_the_serve_launcher_drains_the_server_and_frees_its_port(tmp_path):
    from infer.bench.serving.matrix import wait_for_health
    from infer.models.tensor_parallel import free_local_port
    from infer.server.serve import bind_socket

    port = free_local_port()
    base_url = f"http://127.0.0.1:{port}"
    serve = ["infer", "serve", "--port", str(port), "--max-seq-len", "256", "--max-batch-size", "2"]
    # `infer` from this Python's environment, as nox's session finds it in its own.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        # A process group of its own: whatever is left at the end (a server whose launcher died
        # without it) goes with the group.
        command = [sys.executable, "-c", LAUNCHER, *serve]
        launcher = subprocess.Popen(command, env=env, stderr=stderr, start_new_session=True)
    try:
        wait_for_health(launcher, base_url, timeout_s=180.0, log_path=stderr_path)
        body = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(base_url + "/v1/completions", json=body, timeout=60).status_code == 200
        launcher.send_signal(signal.SIGTERM)
        exit_code = launcher.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    logged = stderr_path.read_text()
    assert exit_code == 0, f"exit {exit_code}, not the server's drained exit 0:\n{logged}"
    assert "stopping: draining" in logged, logged
    bind_socket("127.0.0.1", port).close()  # what the next `infer serve` does first
    assert f"listening on {base_url}\n" in logged, logged
    for phase in ("loaded the weights of smollm2-135m-instruct", "building the engine core for smollm2"):
        timed = re.compile(rf" INFO .*{phase}.*: \d+\.\d s$", re.M)
        assert len(timed.findall(logged)) == 1, f"no line with the seconds of {phase!r}:\n{logged}"
    # The one line naming what the engine turned on and why the rest is off (a CPU here).
    settings = re.findall(r"engine settings: (.*)$", logged, re.M)
    assert len(settings) == 1 and "off: chunked prefill (CPU default)" in settings[0], logged
    assert "leaked" not in logged, logged
