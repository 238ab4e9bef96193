"""The 4-bit layout's references against a per-element reading of the bytes, and their checks.

The oracle reads each weight the way the layout is written down (infer.kernels.int4_linear):
byte k // 2 of row n, low nibble for even k, high for odd, minus the group's zero point (8 when
there is none), times the group's scale; sums of products in float64.
"""

import pytest
import torch

from infer.kernels import dequantize_int4, int4_linear, int4_linear_ref, pack_int4, unpack_int4


def _weight_by_element(qweight, scales, zeros, group_size) -> torch.Tensor:
    N, K = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty(N, K, dtype=torch.float64)
    for n in range(N):
        for k in range(K):
            byte = int(qweight[n, k // 2])
            q = byte & 0x0F if k % 2 == 0 else byte >> 4
            zero = 8 if zeros is None else int(zeros[n, k // group_size])
            out[n, k] = (q - zero) * float(scales[n, k // group_size])
    return out


def _random_weight(N, K, group_size, symmetric, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=generator, dtype=torch.uint8)
    scales = torch.rand(N, K // group_size, generator=generator) * 0.02 + 0.001
    zeros = (
        None
        if symmetric
        else torch.randint(0, 16, (N, K // group_size), generator=generator, dtype=torch.uint8)
    )
    return q, pack_int4(q), scales, zeros


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [8, 16])
def test_dequantize_reads_each_weight_as_the_layout_says(symmetric, group_size):
    q, qweight, scales, zeros = _random_weight(6, 32, group_size, symmetric)
    assert torch.equal(unpack_int4(qweight), q)
    expected = _weight_by_element(qweight, scales, zeros, group_size)
    torch.testing.assert_close(dequantize_int4(qweight, scales, zeros, group_size).double(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linear_is_the_product_with_the_dequantized_weight(dtype, symmetric):
    _, qweight, scales, zeros = _random_weight(24, 64, 16, symmetric, seed=1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(24, dtype=dtype)
    expected = x.double() @ _weight_by_element(qweight, scales, zeros, 16).T + bias.double()
    for fn in (int4_linear_ref, int4_linear):
        y = fn(x, qweight, scales, zeros, 16, bias)
        assert y.dtype == dtype and y.shape == (3, 24)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: {**w, "qweight": w["qweight"].to(torch.int8)}, "qweight must be a 2D uint8"),
        (lambda w: {**w, "group_size": 12}, "group_size must be even and divide"),
        (lambda w: {**w, "scales": w["scales"][:, :1]}, "scales must be"),
        (lambda w: {**w, "zeros": w["scales"].to(torch.int32)}, "zeros must be uint8"),
        (lambda w: {**w, "x": w["x"][:, :8]}, "x's last dim must be K"),
    ],
)
def test_int4_linear_refuses_a_malformed_layout(change, message):
    _, qweight, scales, zeros = _random_weight(4, 32, 16, symmetric=False)
    arguments = change(
        {"x": torch.randn(2, 32), "qweight": qweight, "scales": scales, "zeros": zeros, "group_size": 16}
    )
    with pytest.raises(ValueError, match=message):
        int4_linear(**arguments)
