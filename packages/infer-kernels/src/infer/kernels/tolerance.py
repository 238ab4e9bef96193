"""How close a kernel's output must be to its PyTorch reference: one table for every op and test.

Both sides accumulate in fp32, so they differ only by summation order, fused multiply-adds and
the final rounding to the output dtype: at most about one unit in the last place (ulp) of that
dtype. Each rtol is about two ulps (fp16 ulp <= 2^-10, bf16 ulp <= 2^-7); each atol covers
values near zero where a relative bound means nothing.
"""

from dataclasses import dataclass

import torch


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
