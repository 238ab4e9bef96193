"""Runs a command in place of the calling process: how `nox -s serve` starts `infer serve`.

nox's `session.run` starts a command as its child and waits for it. A SIGTERM (what `kill`,
systemd and Kubernetes send) ended nox at once and left `infer serve` running on its port, never
drained, so the next start failed with "Address already in use". Run in nox's place instead
(os.execve: the same process id), the server gets every signal itself: SIGTERM drains it and it
exits 0, Ctrl-C stops it (infer.server.serve), and its exit status is the one nox's caller sees.

Standard library only: the noxfile imports it in nox's own Python, tests/test_nox_serve.py in
the project's.
"""

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn


def exec_command(command: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Replaces this process with `command`, its program found on env["PATH"], in exactly `env`."""
    program = shutil.which(command[0], path=env.get("PATH"))
    if program is None:
        raise FileNotFoundError(f"{command[0]} is not on the PATH {env.get('PATH')}")
    # What this process printed but has not written yet would be lost with it.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(program, list(command), dict(env))
