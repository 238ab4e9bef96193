"""Which implementation a call takes: the reference on CPU tensors unless told otherwise."""

import pytest
import torch

from infer.kernels import rms_norm, rms_norm_ref, rope, rope_ref, rope_tables, silu_and_mul, silu_and_mul_ref
from infer.kernels._dispatch import use_triton


def test_cpu_tensors_take_the_reference_by_default(monkeypatch):
    monkeypatch.delenv("INFER_KERNELS_BACKEND", raising=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    assert not use_triton(x)
    # Bitwise equal: the reference itself ran, not a kernel within tolerance of it.
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    gate_up = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    q, k = torch.randn(3, 4, 64, dtype=torch.bfloat16), torch.randn(3, 2, 64, dtype=torch.bfloat16)
    cos, sin = rope_tables(64, 8, 10000.0)
    positions = torch.tensor([0, 5, 7])
    expected_q, expected_k = rope_ref(q.clone(), k.clone(), cos, sin, positions)
    rope(q, k, cos, sin, positions)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def test_backend_torch_forces_the_reference(monkeypatch):
    monkeypatch.setenv("INFER_KERNELS_BACKEND", "torch")
    assert not use_triton(torch.randn(2))


def test_an_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("INFER_KERNELS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="INFER_KERNELS_BACKEND must be auto, torch or triton"):
        rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6)


def test_backend_triton_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("INFER_KERNELS_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6)


@pytest.mark.gpu
def test_cuda_tensors_take_triton_by_default(monkeypatch):
    monkeypatch.delenv("INFER_KERNELS_BACKEND", raising=False)
    assert use_triton(torch.randn(2, device="cuda"))
