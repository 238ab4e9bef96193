"""A user's mistake at the command line ends the command with one clear line and a non-zero exit,
never a traceback, and never a server that stays up answering 503 (the real commands, in
subprocesses, as a user runs them)."""

import socket
import subprocess
import sys

import pytest
import torch

from infer.models.random_checkpoint import make_random_checkpoint
from infer.models.tensor_parallel import free_local_port

TIMEOUT_S = 120


def run_infer(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "infer.server.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_random_checkpoint("llama-tiny", tmp_path_factory.mktemp("llama-tiny"))


def test_serve_with_an_unknown_model_says_so_in_one_line_and_exits_2():
    result = run_infer("serve", "--model", "no-such-model", "--port", str(free_local_port()))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infer serve: unknown model 'no-such-model'")


def test_serve_on_a_busy_port_says_so_before_loading_anything(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_infer(
            "serve", "--model", str(tiny_checkpoint), "--port", str(port), "--log-level", "info"
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"infer serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_device_cuda_without_cuda_says_so_and_exits_2(tiny_checkpoint, command):
    args = ["--port", str(free_local_port())] if command == "serve" else ["hello"]
    result = run_infer(command, "--model", str(tiny_checkpoint), "--device", "cuda", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"infer {command}: device 'cuda', but torch {torch.__version__} sees no CUDA device (a CPU build "
        "of torch, or no GPU); use --device cpu, or install the CUDA build of torch on a machine with a GPU"
    ]


def test_generate_with_an_unknown_model_says_so_and_exits_2():
    result = run_infer("generate", "--model", "no-such-model", "hello")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infer generate: unknown model 'no-such-model'")
