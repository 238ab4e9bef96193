"""int8_linear_cpu (ATen's weight-only int8 kernel) against quantized_linear_ref.

The kernel rounds x and the scales to bf16 and returns a bf16 product, widened to x's dtype; the
oracle is the fp32 reference on the same rounded x and scales, so the two differ by the final
bf16 rounding and summation order: the bf16 row of the tolerance table.
"""

import pytest
import torch

from infer.kernels import (
    TOLERANCES,
    int8_cpu_scale,
    int8_linear_cpu,
    int8_linear_cpu_supports,
    quantized_linear_ref,
)

# SmolLM2-135M's Linears (q|k|v, o, gate|up, down, LM head), and smaller ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (100, 64), (64, 16)]


def weights(n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = torch.rand(n, 1, generator=generator) / 127 + 1e-4
    return weight, scale


@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_cpu_matches_the_reference_on_bf16_inputs(rows, n, k, bias):
    weight, scale = weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    b = torch.randn(n) if bias else None
    assert int8_linear_cpu_supports(weight)
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale), b)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    rounded_scale = scale.to(torch.bfloat16).float()
    expected = quantized_linear_ref(x.to(torch.bfloat16).float(), weight, rounded_scale, (1, k))
    if b is not None:
        expected = expected + b
    tolerance = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=tolerance.atol * k**0.5, rtol=tolerance.rtol)


def test_leading_dims_are_kept():
    weight, scale = weights(64, 32)
    x = torch.randn(2, 5, 32)
    out = int8_linear_cpu(x, weight, int8_cpu_scale(scale))
    assert out.shape == (2, 5, 64)
    torch.testing.assert_close(out[1], int8_linear_cpu(x[1], weight, int8_cpu_scale(scale)))


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
