"""int8 weights with one scale per output channel, on a CPU: ATen's `_weight_int8pack_mm`.

A CPU decode step is bound by reading the weights; int8 reads a quarter of fp32's bytes. ATen's
weight-only int8 kernel reads them at ~25 GB/s on the CI-class 2-core machine (fp32's batched
product ~33 GB/s), a 3x faster pass over SmolLM2's Linears than fp32. It takes x and the scales
in bf16 (its fp32 path is a slow fallback, ~3 GB/s), so x is rounded to bf16 on the way in and
the bf16 product widened on the way out: the result equals the reference on x and scales
rounded to bf16, up to the output's bf16 rounding.

The op is lean on purpose (no checks, scales prepared once by `int8_cpu_scale`): a CPU pays
microseconds per call, and a decode step of SmolLM2 makes 121 of them.
"""

import os

import torch

# ATen's kernel reads K in vectors of 16 int8s with aligned loads: another K gives wrong sums or
# a crash, and so does a weight whose data does not start on a 64-byte boundary.
K_MULTIPLE = 16
ALIGNMENT = 64


def int8_linear_cpu_supports(weight: torch.Tensor) -> bool:
    """Whether `int8_linear_cpu` can take this weight (else the caller takes quantized_linear).
    Never under INFER_KERNELS_BACKEND=torch, which asks for the references everywhere."""
    return (
        os.environ.get("INFER_KERNELS_BACKEND") != "torch"
        and weight.dtype == torch.int8
        and weight.dim() == 2
        and weight.shape[1] % K_MULTIPLE == 0
        and weight.is_contiguous()
        and weight.data_ptr() % ALIGNMENT == 0
    )


def int8_cpu_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scales as `int8_linear_cpu` takes them: `[N]` bf16, from `[N, 1]` float32."""
    if scale.dim() != 2 or scale.shape[1] != 1:
        raise ValueError(
            f"int8_linear_cpu takes one scale per output channel, [N, 1]; got {list(scale.shape)}"
        )
    return scale.reshape(-1).to(torch.bfloat16)


def int8_linear_cpu(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ (weight * scale[:, None]).T + bias` in x's dtype, for an int8 `weight` [N, K] that
    `int8_linear_cpu_supports`, the bf16 `scale` [N] of `int8_cpu_scale`, x `[..., K]` on the CPU."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch._weight_int8pack_mm(rows, weight, scale).to(x.dtype)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
