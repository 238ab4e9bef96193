"""How close a kernel's output must be to its PyTorch reference: one table for every op and test.

Both sides accumulate in fp32, so they differ only by summation order, fused multiply-adds and
the final rounding to the output dtype: at most about one unit in the last place (ulp) of that
dtype. Each rtol is about two ulps (fp16 ulp <= 2^-10, bf16 ulp <= 2^-7); each atol covers
values near zero where a relative bound means nothing.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Raise AssertionError unless `actual` matches `expected` within the table's bound for its dtype."""
    tolerance = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tolerance.atol, rtol=tolerance.rtol)


# The gated activations' largest slope: SiLU's is 1.0998, GELU's (tanh form) 1.1289.
MAX_ACTIVATION_SLOPE = 1.2


def assert_gated_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    gate_up: torch.Tensor,
    activation: str,
    gate_up_error: torch.Tensor | None = None,
) -> None:
    """For a fused projection and gated activation (`act(gate) * up`): `actual` against the
    unfused `expected`, whose projection output was `gate_up` (gate, then up, in the output's
    dtype). The fused kernel's gate and up are each within a rounding of the reference's (one
    ulp of the dtype, or `gate_up_error` where the output is fp32 and the bound is the sums'
    own), which the activation and the product carry through their slopes; then one more
    rounding of the output."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    gate, up = gate_up.float().chunk(2, dim=-1)
    eps, tiny = torch.finfo(actual.dtype).eps, torch.finfo(actual.dtype).tiny
    if gate_up_error is None:
        gate_error, up_error = gate.abs() * eps + tiny, up.abs() * eps + tiny
    else:
        gate_error, up_error = gate_up_error.chunk(2, dim=-1)
    activated = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    bound = MAX_ACTIVATION_SLOPE * gate_error * (up.abs() + up_error) + activated.abs() * up_error
    bound += 2 * (expected.float().abs() * eps + tiny)
    error = (actual.float() - expected.float()).abs()
    assert (error <= bound).all(), f"error {(error - bound).max().item():.3g} above its bound"
