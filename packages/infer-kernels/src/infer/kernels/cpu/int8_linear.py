"""int8 weights with one scale per output channel, on a CPU.

A CPU decode step is bound by reading the weights; int8 reads a quarter of fp32's bytes. Two
kernels:
- up to AVX2_MAX_ROWS rows (decode steps), int8_gemv_cpu.c, a C kernel of infer.kernels.cpu.native
  (with `native=True`, the default). It rounds each row of x to int16 and
  multiplies in integers, prefetching the weights into L2; on the 2-core CI-class VM it reads
  SmolLM2's int8 weights 1.65-3.0x faster than ATen's kernel with its conversions
  (kernels-bench/cpu_native_kernels.py,
  docs/benchmarks/quantization.md#cpu-decisions-what-chose-them). Its result equals the float
  reference on x rounded to int16 with a scale per row (2^-15 of the row's largest entry),
  then summed in fp32.
- larger batches (prompts), and with `native=False` or where the C kernel cannot be built: ATen's
  `_weight_int8pack_mm`. It takes x and the scales in bf16 (its fp32 path is a slow fallback, ~3
  GB/s), so x is rounded to bf16 on the way in and the bf16 product widened on the way out: the
  result equals the reference on x and scales rounded to bf16, up to the output's bf16 rounding.

The op is lean on purpose (no checks, scales prepared once by `int8_cpu_scale`): a CPU pays
microseconds per call, and a decode step of SmolLM2 makes 121 of them.
"""

import ctypes
import os
from typing import NamedTuple

import torch

from infer.kernels.cpu.native import POINTER, SIZE, native_function

# ATen's kernel reads K in vectors of 16 int8s with aligned loads: another K gives wrong sums or
# a crash, and so does a weight whose data does not start on a 64-byte boundary. The AVX2 kernel
# reads K in 16s too.
K_MULTIPLE = 16
ALIGNMENT = 64
# Rows up to which the AVX2 kernel runs: it re-reads each block of weights from L1 once a row,
# which beat ATen's kernel at 1, 2, 4 and 8 rows on the CI-class VM
# (docs/benchmarks/quantization.md#cpu-decisions-what-chose-them).
AVX2_MAX_ROWS = 8


class Int8CpuScale(NamedTuple):
    """One Linear's scales, [N], as each kernel takes them."""

    float32: torch.Tensor
    bfloat16: torch.Tensor


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


def int8_cpu_scale(scale: torch.Tensor) -> Int8CpuScale:
    """The scales as `int8_linear_cpu` takes them, from `[N, 1]` float32."""
    if scale.dim() != 2 or scale.shape[1] != 1:
        raise ValueError(
            f"int8_linear_cpu takes one scale per output channel, [N, 1]; got {list(scale.shape)}"
        )
    flat = scale.reshape(-1)
    return Int8CpuScale(flat.to(torch.float32).contiguous(), flat.to(torch.bfloat16))


# int8_gemv_cpu.c's entry point: (x, weight, scales, out, rows, n, k, threads) -> status.
_INT8_GEMV = (
    "int8_gemv_cpu.c",
    "int8_gemv",
    (POINTER, POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, ctypes.c_int),
)


def int8_linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: Int8CpuScale,
    bias: torch.Tensor | None = None,
    *,
    native: bool = True,
) -> torch.Tensor:
    """`x @ (weight * scale[:, None]).T + bias` in x's dtype, for an int8 `weight` [N, K] that
    `int8_linear_cpu_supports`, the scales of `int8_cpu_scale`, x `[..., K]` on the CPU.
    `native`: a few rows may take the C kernel (else ATen's, always)."""
    rows = x.reshape(-1, x.shape[-1])
    gemv = native_function(*_INT8_GEMV) if native and rows.shape[0] <= AVX2_MAX_ROWS else None
    if gemv is not None:
        rows = rows.to(torch.float32).contiguous()
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
        threads = torch.get_num_threads()
        status = gemv(rows.data_ptr(), weight.data_ptr(), scale.float32.data_ptr(), out.data_ptr(),
                      rows.shape[0], weight.shape[0], rows.shape[1], threads)  # fmt: skip
        if status != 0:
            raise MemoryError("int8_gemv_cpu could not allocate its int16 copy of x")
        out = out.to(x.dtype)
    else:
        out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), weight, scale.bfloat16).to(x.dtype)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
