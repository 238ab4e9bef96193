"""int8_linear_cpu's two kernels (`native=True` and `native=False`) against quantized_linear_ref,
each on the input it rounds to.

- ATen's weight-only int8 kernel rounds x and the scales to bf16 and returns a bf16 product,
  widened to x's dtype: the oracle is the fp32 reference on the same rounded x and scales, so the
  two differ by the final bf16 rounding and summation order (the bf16 row of the tolerances).
- infer.kernels' AVX2 kernel rounds each row of x to int16 with its own scale, sums in integers
  and scales in fp32: the oracle is the fp32 reference on x rounded the same way (`int16_rows`,
  written here from the kernel's contract), so the two differ by fp32 rounding.
"""

import logging
import platform

import pytest
import torch

from infer.kernels import (
    TOLERANCES,
    int8_cpu_scale,
    int8_linear_cpu,
    int8_linear_cpu_supports,
    native_cpu_kernels_available,
    quantized_linear_ref,
)
from infer.kernels.cpu import native
from infer.kernels.cpu.int8_linear import AVX2_MAX_ROWS

# SmolLM2-135M's Linears (q|k|v, o, gate|up, down, LM head), and smaller ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (100, 64), (64, 16)]

needs_avx2 = pytest.mark.skipif(
    platform.system() != "Linux"
    or platform.machine() != "x86_64"
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="infer.kernels' int8 CPU kernel is built for x86-64 Linux with AVX2",
)


def weights(n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = torch.rand(n, 1, generator=generator) / 127 + 1e-4
    return weight, scale


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to a multiple of its int16 step, max |row| / 32767 (the AVX2
    kernel's contract), in fp32 arithmetic as the kernel does it."""
    step = x.abs().amax(dim=-1, keepdim=True) / 32767
    return torch.round(x * (1 / step)).clamp(-32767, 32767) * step


@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_aten_matches_the_reference_on_bf16_inputs(rows, n, k, bias):
    weight, scale = weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    b = torch.randn(n) if bias else None
    assert int8_linear_cpu_supports(weight)
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale), b, native=False)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    rounded_scale = scale.to(torch.bfloat16).float()
    expected = quantized_linear_ref(x.to(torch.bfloat16).float(), weight, rounded_scale, (1, k))
    if b is not None:
        expected = expected + b
    tolerance = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=tolerance.atol * k**0.5, rtol=tolerance.rtol)


@needs_avx2
def test_the_c_kernels_are_built_here():
    """On x86-64 Linux with AVX2 (CI's machine) the kernels must build: otherwise every test of
    them would pass on ATen's fallback."""
    assert native_cpu_kernels_available()


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, AVX2_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [*SHAPES, (130, 8192)])
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_matches_the_reference_on_int16_rows(rows, n, k, bias):
    weight, scale = weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 7] = 250.0  # an outlier, as real activations have
    b = torch.randn(n) if bias else None
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale), b)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    expected = quantized_linear_ref(int16_rows(x), weight, scale, (1, k))
    if b is not None:
        expected = expected + b
    tolerance = TOLERANCES[torch.float32]
    torch.testing.assert_close(out, expected, atol=tolerance.atol * k**0.5, rtol=tolerance.rtol)


@needs_avx2
def test_avx2_sums_past_int32_without_overflow():
    """The largest products over 8192 columns: each int32 lane would overflow past 4096 columns,
    and the lanes' total at any width, were the sums not folded into floats."""
    k = 8192
    weight = torch.full((8, k), -128, dtype=torch.int8)
    scale = torch.ones(8, 1)
    x = -torch.ones(1, k)
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale))
    torch.testing.assert_close(out, torch.full((1, 8), 128.0 * k))


@needs_avx2
def test_avx2_gives_nan_for_a_row_with_nan_or_infinity():
    weight, scale = weights(9, 32)
    x = torch.randn(3, 32)
    x[0, 5], x[2, 0] = float("nan"), float("inf")
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale))
    assert out[0].isnan().all() and out[2].isnan().all()
    expected = quantized_linear_ref(int16_rows(x[1:2]), weight, scale, (1, 32))
    torch.testing.assert_close(out[1:2], expected)


@needs_avx2
def test_rows_beyond_the_avx2_kernels_take_aten():
    weight, scale = weights(64, 32)
    x = torch.randn(AVX2_MAX_ROWS + 1, 32)
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale))
    aten, aten_few = (
        int8_linear_cpu(rows, weight, int8_cpu_scale(scale), native=False) for rows in (x, x[:2])
    )
    torch.testing.assert_close(out, aten)
    # and a few rows do not: the two kernels round x differently
    assert not torch.equal(int8_linear_cpu(x[:2], weight, int8_cpu_scale(scale)), aten_few)


@pytest.mark.parametrize("native", [True, False], ids=["native", "aten"])
def test_leading_dims_are_kept(native):
    weight, scale = weights(64, 32)
    x = torch.randn(2, 3, 32)
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale), native=native)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out[1], int8_linear_cpu(x[1], weight, int8_cpu_scale(scale), native=native))


def test_weights_the_kernel_cannot_take_are_refused(monkeypatch):
    weight, _ = weights(64, 48)
    assert int8_linear_cpu_supports(weight)
    # K not a multiple of 16 (ATen's kernel gives wrong sums or crashes).
    assert not int8_linear_cpu_supports(weights(64, 100)[0])
    # Data that does not start on a 64-byte boundary, as a tensor read in place from a file may.
    storage = torch.empty(64 * 48 + 8, dtype=torch.int8)
    assert not int8_linear_cpu_supports(storage[8:].view(64, 48))
    assert not int8_linear_cpu_supports(weight.float())
    monkeypatch.setenv("INFER_KERNELS_BACKEND", "torch")
    assert not int8_linear_cpu_supports(weight)
    with pytest.raises(ValueError, match="one scale per output channel"):
        int8_cpu_scale(torch.ones(64, 2))


@needs_avx2
def test_a_build_is_kept_under_infer_home_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    build = native.load_native.__wrapped__
    assert build("int8_gemv_cpu.c") is not None
    (library,) = (tmp_path / "kernels").glob("int8_gemv_cpu-*.so")
    built_at = library.stat().st_mtime_ns
    assert build("int8_gemv_cpu.c") is not None
    # Not built again: a build is renamed into place, which would give the file a new time.
    assert list((tmp_path / "kernels").iterdir()) == [library]
    assert library.stat().st_mtime_ns == built_at


def test_without_a_compiler_the_kernel_is_not_used_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="infer.kernels.cpu.native"):
        assert native.load_native.__wrapped__("int8_gemv_cpu.c") is None
    assert "int8_gemv_cpu.c is not used" in caplog.text
    assert not list(tmp_path.glob("kernels/*.so"))


def test_infer_kernels_backend_torch_turns_the_kernel_off(monkeypatch, caplog):
    monkeypatch.setenv("INFER_KERNELS_BACKEND", "torch")
    with caplog.at_level(logging.WARNING, logger="infer.kernels.cpu.native"):
        assert native.load_native.__wrapped__("int8_gemv_cpu.c") is None
    assert "INFER_KERNELS_BACKEND=torch" in caplog.text
