"""Weights in GGUF's blocks of 32 (Q4_0, Q4_1, Q8_0), run as stored, on a CPU.

A packed weight [N, K] is a uint8 tensor [N, K // 32 * block bytes]: each row the file's blocks,
one after another (`GGUF_FORMATS` gives each format's bytes and layout; gguf.quants is the spec).
A CPU decode step is bound by reading the weights; Q4_1 reads 0.625 bytes a weight, 1/6.4 of fp32.

- `gguf_linear_cpu(x, weight, fmt)`: gguf_gemv_cpu.c (infer.kernels.cpu.native) where `native` and
  it builds, as llama.cpp computes: x rounded to int8 in blocks of 32 with a scale (and the sum of
  its entries) per block, integer dot products per block, fp32 sums of their scaled results. Its
  result is `gguf_linear_cpu_q8_ref`'s, the fp32 product of that rounded x and the dequantized
  weight, up to the order of fp32 sums. Elsewhere, ATen: the weight dequantized at each call
  (`dequantize_gguf`) and `F.linear`, `gguf_linear_cpu_ref`; a model whose Linears call it many
  times dequantizes once instead where `gguf_linear_cpu_native()` is false.
  On one row (batch-1 decode) it takes the best variant the CPU runs: AVX-512 VNNI, else AVX2
  (`gguf_cpu_variants`, `use_gguf_cpu_variant`).
- `dequantize_gguf(weight, fmt)`: the fp32 weight, by gguf.quants' formulas; also the embedding
  lookup's path (`dequantize_gguf(weight[ids], fmt)`).
"""

import ctypes
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from infer.kernels.cpu.native import POINTER, SIZE, load_native, native_function

BLOCK = 32  # weights a block, in every format here


class GgufFormat(NamedTuple):
    """One block format: its ggml type id (what the C kernel takes) and bytes a block."""

    type_id: int
    block_bytes: int


GGUF_FORMATS = {"q4_0": GgufFormat(2, 18), "q4_1": GgufFormat(3, 20), "q8_0": GgufFormat(8, 34)}


def gguf_row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one packed row of `in_features` weights in `fmt`."""
    if in_features % BLOCK:
        raise ValueError(f"a GGUF block weight has K % {BLOCK} == 0, got K = {in_features}")
    return in_features // BLOCK * GGUF_FORMATS[fmt].block_bytes


def dequantize_gguf(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 [N, K] of a packed weight [N, K // 32 * block bytes] in `fmt`."""
    rows = weight.shape[0]
    blocks = weight.reshape(rows, -1, GGUF_FORMATS[fmt].block_bytes)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [N, blocks, 1]
    if fmt == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, -1)
    packed = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]
    # Byte j: element j in its low nibble, element j + 16 in its high one.
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    if fmt == "q4_0":
        return (d * (q - 8)).reshape(rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows, -1)


def quantize_rows_q8_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the C kernel rounds it, back in float32: each block of 32 to int8 with the
    scale max |x_b| / 127, rounding half away from zero (C's roundf)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    scaled = blocks * inverse
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * scale).reshape(x.shape)


def gguf_linear_cpu_ref(
    x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ dequantize_gguf(weight).T + bias` in fp32, in x's dtype: the product of the weight as
    stored (the ATen path)."""
    return F.linear(x.float(), dequantize_gguf(weight, fmt), None if bias is None else bias.float()).to(
        x.dtype
    )


def gguf_linear_cpu_q8_ref(
    x: torch.Tensor, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the C kernel computes: `gguf_linear_cpu_ref` of x rounded by `quantize_rows_q8_ref`,
    summed in float64 (the kernel's fp32 sums differ from it by their rounding only)."""
    out = F.linear(quantize_rows_q8_ref(x).double(), dequantize_gguf(weight, fmt).double())
    return (out if bias is None else out + bias.double()).to(x.dtype)


def gguf_linear_cpu_supports(weight: torch.Tensor, fmt: str, in_features: int) -> bool:
    """Whether `gguf_linear_cpu` takes this packed weight (never under INFER_KERNELS_BACKEND=torch,
    which asks for the references everywhere)."""
    return (
        os.environ.get("INFER_KERNELS_BACKEND") != "torch"
        and fmt in GGUF_FORMATS
        and in_features % BLOCK == 0
        and weight.dtype == torch.uint8
        and weight.dim() == 2
        and weight.shape[1] == gguf_row_bytes(fmt, in_features)
        and weight.is_contiguous()
    )


# gguf_gemv_cpu.c's entry point: (format, x, weight, out, rows, n, k, threads) -> status.
_GGUF_GEMV = (
    "gguf_gemv_cpu.c",
    "gguf_gemv",
    (ctypes.c_int, POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, ctypes.c_int),
)


def gguf_linear_cpu_native() -> bool:
    """Whether `gguf_linear_cpu`'s C kernel runs here: it builds (a C compiler is present) and
    INFER_KERNELS_BACKEND is not torch. Where it does not, `gguf_linear_cpu` dequantizes the
    weight at every call."""
    return native_function(*_GGUF_GEMV) is not None


def gguf_linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str,
    bias: torch.Tensor | None = None,
    *,
    native: bool = True,
) -> torch.Tensor:
    """`x @ dequantize_gguf(weight, fmt).T + bias` in x's dtype, x `[..., K]` on the CPU, for a
    packed weight that `gguf_linear_cpu_supports`. `native`: the C kernel where it builds."""
    gemv = native_function(*_GGUF_GEMV) if native else None
    if gemv is None:
        return gguf_linear_cpu_ref(x, weight, fmt, bias)
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    status = gemv(GGUF_FORMATS[fmt].type_id, rows.data_ptr(), weight.data_ptr(), out.data_ptr(),
                  rows.shape[0], weight.shape[0], rows.shape[1], torch.get_num_threads())  # fmt: skip
    if status != 0:
        raise (
            MemoryError("gguf_gemv_cpu could not allocate its int8 copy of x")
            if status == -1
            else ValueError(f"gguf_gemv_cpu does not take {fmt} with K = {rows.shape[1]}")
        )
    out = out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


# The C kernel's one-row variants, by what they need of the CPU (gguf_gemv_cpu.c's GGUF_VARIANT_*).
GGUF_CPU_VARIANTS = {"avx2": 0, "avx512_vnni": 1}


def gguf_cpu_variants() -> list[str]:
    """The C kernel's variants this CPU runs, best last (none where it does not build)."""
    library = load_native("gguf_gemv_cpu.c")
    if library is None:
        return []
    runs = library.gguf_gemv_variants()
    return [name for name, bit in GGUF_CPU_VARIANTS.items() if runs >> bit & 1]


def use_gguf_cpu_variant(name: str | None) -> None:
    """Makes `gguf_linear_cpu`'s one-row product take the variant `name` (one of
    `gguf_cpu_variants()`), or the best one the CPU runs for None (the default). For tests and
    benchmarks; the decoder stack's library always takes the best."""
    library = load_native("gguf_gemv_cpu.c")
    if library is None or library.gguf_gemv_use_variant(-1 if name is None else GGUF_CPU_VARIANTS[name]) != 0:
        raise ValueError(f"this CPU does not run gguf_gemv_cpu.c's {name} variant")
