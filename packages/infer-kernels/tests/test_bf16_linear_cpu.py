"""bf16_linear_cpu (bf16_gemv_cpu.c for a few rows, ATen past them) against the plain PyTorch
oracle: the bf16 weight upcast to float32 and an fp32 product. The kernel widens each weight to
fp32 exactly and sums in fp32, so the two differ by the order of the fp32 sums alone: an
absolute 1e-5 * sqrt(K) on outputs of about unit size (x and the weight's rows of unit variance
over sqrt(K)).
"""

import platform

import pytest
import torch

from infer.kernels import bf16_linear_cpu, bf16_linear_cpu_native, bf16_linear_cpu_supports
from infer.kernels.cpu.bf16_linear import MAX_ROWS

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux"
    or platform.machine() != "x86_64"
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="infer.kernels' C kernels are built for x86-64 Linux with AVX2",
)

# SmolLM2-135M's Linears (q|k|v, gate|up, down, LM head), and odd ones: N not a multiple of the
# four rows a pass reads, K not a multiple of the eight a vector holds.
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576), (7, 9), (13, 37), (101, 8), (5, 3)]


def oracle(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Written here from the contract, not imported: upcast, then an fp32 product in float64."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


def make(rows: int, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    return x, weight, bias


def test_the_c_kernel_is_built_here():
    """Otherwise every test below would pass on ATen's path."""
    assert bf16_linear_cpu_native()


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_c_kernel_matches_the_upcast_product(rows, n, k):
    x, weight, bias = make(rows, n, k)
    assert bf16_linear_cpu_supports(weight)
    out = bf16_linear_cpu(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out, oracle(x, weight, bias), rtol=0, atol=1e-5 * k**0.5)


def test_many_rows_and_no_native_take_aten():
    x, weight, bias = make(MAX_ROWS + 5, 40, 24)
    for out in (bf16_linear_cpu(x, weight, bias), bf16_linear_cpu(x[:2], weight, None, native=False)):
        rows = out.shape[0]
        expected = oracle(x[:rows], weight, bias if rows > 2 else None)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * 24**0.5)


def test_leading_dims_are_kept():
    x, weight, _ = make(6, 12, 16)
    out = bf16_linear_cpu(x.view(2, 3, 16), weight)
    assert out.shape == (2, 3, 12)
    torch.testing.assert_close(out.view(6, 12), oracle(x, weight, None), rtol=0, atol=1e-4)
