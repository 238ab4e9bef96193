"""bf16 weights times float32 activations, on a CPU.

A CPU decode step is bound by reading the weights; bf16 reads half of fp32's bytes. Up to
MAX_ROWS rows of x (decode steps) take bf16_gemv_cpu.c, a C kernel of infer.kernels.cpu.native
(with `native=True`, the default), which widens each weight to fp32 in registers (exact) and
multiplies and sums in fp32: its result is `bf16_linear_cpu_ref`'s, the weight upcast and an fp32
product, up to the order of the fp32 sums. Larger inputs (prompts), and with `native=False` or
where the C kernel cannot be built, upcast the weight and take ATen's fp32 product.
"""

import ctypes

import torch

from infer.kernels.cpu.native import POINTER, SIZE, native_function

# Rows up to which the C kernel runs: it re-reads each block of four weight rows from L1 once a
# row of x, which pays for a few rows, as int8_linear_cpu's AVX2_MAX_ROWS.
MAX_ROWS = 8

# bf16_gemv_cpu.c's entry point: (x, weight, out, rows, n, k, threads) -> status.
_BF16_GEMV = ("bf16_gemv_cpu.c", "bf16_gemv", (POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, ctypes.c_int))


def bf16_linear_cpu_supports(weight: torch.Tensor) -> bool:
    """Whether the C kernel can read this weight: contiguous bf16 [N, K] on the CPU."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.is_contiguous()
    )


def bf16_linear_cpu_native() -> bool:
    """Whether bf16_gemv_cpu.c builds and loads here."""
    return native_function(*_BF16_GEMV) is not None


def bf16_linear_cpu_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: the bf16 weight upcast to float32 and an fp32 product, x float32."""
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())


def bf16_linear_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, native: bool = True
) -> torch.Tensor:
    """`x @ weight.T + bias` in float32 for a bf16 `weight` [N, K] that `bf16_linear_cpu_supports`,
    x float32 `[..., K]` on the CPU. `native`: a few rows may take the C kernel."""
    rows = x.reshape(-1, x.shape[-1])
    gemv = native_function(*_BF16_GEMV) if native and rows.shape[0] <= MAX_ROWS else None
    if gemv is None:
        return bf16_linear_cpu_ref(x, weight, bias)
    rows = rows.to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    gemv(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], weight.shape[0], rows.shape[1],
         torch.get_num_threads())  # fmt: skip
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
