"""Runs the Triton kernels themselves on machines without a GPU, through Triton's interpreter.

Triton decides between a compiled and an interpreted kernel when each `@triton.jit` function is
defined, reading TRITON_INTERPRET then: its own library functions (tl.sigmoid, tl.sum) at
`import triton`, ours when infer.kernels is imported. So TRITON_INTERPRET=1 must be in the
environment before anything imports triton; the repository's root conftest.py sets it on
machines without CUDA (this file repeats it for runs from elsewhere) and `triton_on_cpu` fails
loudly if triton was imported too early.

INFER_KERNELS_BACKEND=triton is set per test (fixture `triton_on_cpu`), never for the whole
process: the other packages' tests call the ops on CPU tensors and must keep the fast reference.
On a CUDA machine nothing is interpreted; the CPU-interpreter tests skip and the `gpu` tests run.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_library_is_interpreted() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sigmoid, InterpretedFunction)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route CPU tensors through the (interpreted) Triton kernels for this test."""
    if not INTERPRETED:
        pytest.skip("Triton runs natively here: the `gpu` tests cover the kernels")
    if not _triton_library_is_interpreted():
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
            "the CPU; set it in the environment or in the root conftest.py before importing triton"
        )
    monkeypatch.setenv("INFER_KERNELS_BACKEND", "triton")


@pytest.fixture
def cuda():
    return torch.device("cuda")
