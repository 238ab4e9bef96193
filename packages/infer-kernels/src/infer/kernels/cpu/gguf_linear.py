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
  lookup's path (`dequantize_gguf(gguf_file_rows(weight, fmt, ids), gguf_file_format(fmt))`).

One layout is not the file's: "q8_0x4" (`repack_gguf(weight, "q8_0")`, made once at load) holds
the same bytes with each group of four rows interleaved, block index by block index: the four
rows' fp16 scales (8 bytes, converted by one instruction) then their four blocks of 32 int8
quants (128 bytes), so that the one-row product reads one stream with its quants 8-byte aligned
(llama.cpp's CPU backend repacks Q4_0 so, block_q4_0x4). The last n % 4 rows stay as the file has
them, after the groups. `gguf_file_rows` gives rows back in the file's layout.
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


# The file's formats by their ggml ids; "q8_0x4" is infer's own layout of Q8_0 (the module's
# docstring), its id past ggml's.
GGUF_FORMATS = {
    "q4_0": GgufFormat(2, 18),
    "q4_1": GgufFormat(3, 20),
    "q8_0": GgufFormat(8, 34),
    "q8_0x4": GgufFormat(108, 34),
}
# A file format -> the layout the one-row product reads faster (repack_gguf).
GGUF_REPACKED = {"q8_0": "q8_0x4"}
ROWS_A_GROUP = 4  # weight rows interleaved in a repacked layout
_Q8_0_BYTES = GGUF_FORMATS["q8_0"].block_bytes  # a Q8_0 block: its fp16 scale, then BLOCK int8 quants
_SCALE_BYTES = _Q8_0_BYTES - BLOCK


def gguf_row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one packed row of `in_features` weights in `fmt`."""
    if in_features % BLOCK:
        raise ValueError(f"a GGUF block weight has K % {BLOCK} == 0, got K = {in_features}")
    return in_features // BLOCK * GGUF_FORMATS[fmt].block_bytes


def gguf_file_format(fmt: str) -> str:
    """The file format whose blocks `fmt` holds: itself, or the one it was repacked from."""
    return next((file for file, layout in GGUF_REPACKED.items() if layout == fmt), fmt)


def repack_gguf(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """A packed weight in the file format `fmt` (a key of GGUF_REPACKED) as its repacked layout,
    the same shape and bytes (the module's docstring)."""
    if fmt != "q8_0":
        raise ValueError(f"repack_gguf takes q8_0 weights (GGUF_REPACKED), got {fmt}")
    n, row_bytes = weight.shape
    head = n - n % ROWS_A_GROUP
    groups = weight[:head].reshape(-1, ROWS_A_GROUP, row_bytes // _Q8_0_BYTES, _Q8_0_BYTES).transpose(1, 2)
    scales, quants = groups[..., :_SCALE_BYTES], groups[..., _SCALE_BYTES:]
    interleaved = torch.cat([scales.flatten(-2), quants.flatten(-2)], dim=-1)
    return torch.cat([interleaved.reshape(head, row_bytes), weight[head:]]).contiguous()


def _unpack_groups(groups: torch.Tensor) -> torch.Tensor:
    """Whole groups of a repacked weight, uint8 [groups * 4, row bytes], in the file's layout."""
    row_bytes = groups.shape[1]
    blocks = groups.reshape(-1, row_bytes // _Q8_0_BYTES, ROWS_A_GROUP * _Q8_0_BYTES)
    scales = blocks[..., : _SCALE_BYTES * ROWS_A_GROUP].unflatten(-1, (ROWS_A_GROUP, _SCALE_BYTES))
    quants = blocks[..., _SCALE_BYTES * ROWS_A_GROUP :].unflatten(-1, (ROWS_A_GROUP, BLOCK))
    return torch.cat([scales, quants], dim=-1).transpose(1, 2).reshape(-1, row_bytes)


def gguf_file_rows(weight: torch.Tensor, fmt: str, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (int64 [m]; every row for None) of a packed weight in `fmt`, uint8 [m, row
    bytes] in the file's layout: the rows as stored for a file format, unpacked for a repacked one."""
    if fmt not in GGUF_REPACKED.values():
        return weight if ids is None else weight.index_select(0, ids)
    n = weight.shape[0]
    head = n - n % ROWS_A_GROUP
    if ids is None:
        return torch.cat([_unpack_groups(weight[:head]), weight[head:]])
    if head == 0:
        return weight.index_select(0, ids)
    # Each id's group (its four stored rows) unpacked, and the id's row of it; rows past the last
    # group as stored.
    in_group = ids < head
    first = torch.where(in_group, ids - ids % ROWS_A_GROUP, 0)
    group_rows = (first[:, None] + torch.arange(ROWS_A_GROUP)).reshape(-1)
    unpacked = _unpack_groups(weight.index_select(0, group_rows)).view(len(ids), ROWS_A_GROUP, -1)
    picked = unpacked[torch.arange(len(ids)), ids % ROWS_A_GROUP]
    return torch.where(in_group[:, None], picked, weight.index_select(0, torch.where(in_group, 0, ids)))


def dequantize_gguf(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 [N, K] of a packed weight [N, K // 32 * block bytes] in `fmt`."""
    if fmt in GGUF_REPACKED.values():
        return dequantize_gguf(gguf_file_rows(weight, fmt), gguf_file_format(fmt))
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
