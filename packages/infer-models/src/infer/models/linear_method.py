"""How a Linear computes `x @ weight.T + bias`: one method per weight format and device, picked
once by the kernel policy (infer.models.kernel_policy) and applied by `Linear.forward` as
`self.method.apply(self, x)` (vLLM's `quant_method`). A new format is a new method here, not an
`if` in the model.

- `DenseMethod`: ATen, with the CPU split path of `dense_linear` for a few fp32 rows.
- `TritonGemvMethod` (EngineConfig.use_triton_gemv, CUDA): a dense weight's one-row inputs
  (batch-1 decode) go to infer.kernels' Triton GEMV instead of cuBLAS: faster at the 1-2B
  models' widths, and a kernel that programmatic dependent launch overlaps with its neighbours;
  a gate/up projection's one row takes `gated_gemv`, its activation in the same kernel. Larger
  inputs take ATen as `DenseMethod`.
- `QuantizedMethod`: 8-bit weights with block scales (int8, fp8) through `quantized_linear`; an
  int8 gate/up projection's one CUDA row takes `quantized_gated_gemv` (`gated_gemv` set), its
  one-row product being that GEMV anyway.
- `Int4Method`: 4-bit weights with group scales and zero points (GPTQ, AWQ, int4 at load)
  through `int4_linear`, x's columns gathered first where the weight's are in act-order; a
  gate/up projection's one CUDA row takes `int4_gated_gemv`, its activation in the same kernel.
- `CpuInt8Method`: per-channel int8 weights on a CPU through `int8_linear_cpu`: a few rows in
  infer.kernels' AVX2 kernel where `native` (EngineConfig.use_native_cpu_kernels) and it builds,
  else ATen's int8 product.
- `CpuBf16Method`: a bf16 weight under float32 activations on a CPU (infer.models.bf16_cpu)
  through `bf16_linear_cpu`: a few rows in infer.kernels' AVX2 kernel where `native` and it
  builds, else the weight upcast and ATen's fp32 product; bf16 activations take `DenseMethod`'s.
- `GgufMethod`: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks on a CPU through `gguf_linear_cpu`: the C
  kernel where `native` and it builds, else the weight dequantized and ATen's product.
- `DequantizedGgufMethod`: a GGUF weight where that C kernel does not run (no C compiler, or
  the C kernels turned off): dequantized once, at build, and `DenseMethod`'s product on it.

`apply_gated(layer, x, activation)` is a gate/up projection followed by its activation
(`act(gate) * up`); methods without a fused kernel for it run the two ops.

`pdl` (KernelPolicy.use_pdl): the method's Triton kernels launch one-row inputs with programmatic
dependent launch (`launches_pdl`).

On a CPU, fp32 `F.linear` of a few rows is a BLAS matrix-vector product, which the bundled MKL
runs on one thread: on the CI-class 2-core machine it reads a weight that is not in cache at
~15 GB/s of the ~40 GB/s the machine gives, and a decode step is nothing but such products
(SmolLM2's decode spent 32 of its 45 ms a token in them). `dense_linear` splits the weight's
rows into `CPU_SPLIT` parts and runs them as one batched product, which torch spreads over its
threads: the same arithmetic for each output (one row of the weight against x), at ~38 GB/s.
Larger inputs (prefill chunks), other dtypes (bf16's `F.linear` reads at ~25 GB/s there, its
batched product at ~14) and other devices keep `F.linear`.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from infer.kernels import (
    Int8CpuScale,
    bf16_linear_cpu,
    dequantize_gguf,
    gated_gemv,
    gelu_tanh_and_mul,
    gemv,
    gguf_linear_cpu,
    int4_gated_gemv,
    int4_linear,
    int8_linear_cpu,
    quantized_gated_gemv,
    quantized_linear,
    silu_and_mul,
)

# At most this many rows take the split path: measured on the 2-core CI machine, the batched
# product reads at 35-38 GB/s up to 4 rows and falls to F.linear's speed from 8.
CPU_SPLIT_MAX_ROWS = 4
CPU_SPLIT = 8  # parts of the weight's rows: more than the threads, so that they share the work evenly

# A gated activation's op by its infer.kernels name.
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def launches_pdl(use_pdl: bool, x: torch.Tensor) -> bool:
    """Whether a kernel over `x` (its first dim the tokens) launches with programmatic dependent
    launch: with `use_pdl`, for one token. PDL is correct for any launch; it pays where kernels
    are short single waves (batch-1 decode) and costs on long multi-wave ones (infer.kernels.pdl,
    docs/architecture.md "The build step")."""
    return use_pdl and x.shape[0] == 1


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, x `[M, in]`; for fp32 on a CPU with M <= CPU_SPLIT_MAX_ROWS
    as one batched product over CPU_SPLIT row blocks of the weight (see the module)."""
    num_out = weight.shape[0]
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[0] > CPU_SPLIT_MAX_ROWS
        or num_out % CPU_SPLIT
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    num_rows, num_in = x.shape
    parts = weight.view(CPU_SPLIT, num_out // CPU_SPLIT, num_in)
    out = torch.bmm(parts, x.t().unsqueeze(0).expand(CPU_SPLIT, num_in, num_rows))  # [parts, out/parts, M]
    out = out.view(num_out, num_rows).t()
    if num_rows > 1:
        out = out.contiguous()
    return out if bias is None else out + bias


class LinearMethod(Protocol):
    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias`."""

    def apply_gated(self, layer, x: torch.Tensor, activation: str) -> torch.Tensor:
        """`act(gate) * up` of the gate/up projection `apply(layer, x)`."""


def _one_row(layer, x: torch.Tensor) -> bool:
    return x.numel() == layer.in_features


@dataclass(frozen=True)
class DenseMethod:
    """ATen (and `dense_linear`'s CPU split path); the activation's op after a gate/up projection."""

    pdl: bool = False

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer, x: torch.Tensor, activation: str) -> torch.Tensor:
        return GATED_ACTIVATIONS[activation](self.apply(layer, x), pdl=launches_pdl(self.pdl, x))


@dataclass(frozen=True)
class TritonGemvMethod(DenseMethod):
    """A dense weight on CUDA: one row through infer.kernels' GEMV (gate/up: `gated_gemv`), more
    rows as `DenseMethod`."""

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if _one_row(layer, x):
            return gemv(x, layer.weight, layer.bias, pdl=self.pdl)
        return super().apply(layer, x)

    def apply_gated(self, layer, x: torch.Tensor, activation: str) -> torch.Tensor:
        if _one_row(layer, x):
            return gated_gemv(x, layer.weight, layer.bias, activation=activation, pdl=self.pdl)
        return super().apply_gated(layer, x, activation)


@dataclass(frozen=True)
class QuantizedMethod(DenseMethod):
    """8-bit weights with block scales through `quantized_linear`. `gated_gemv`: a gate/up
    projection's one CUDA row and its activation run as `quantized_gated_gemv`. The policy sets
    it for int8, never for fp8: on an H100, Qwen3-8B's batch-1 decode ran 2% faster in int8 and 5%
    slower in fp8, whose gated tiles (twice the plain one's rows, each column scaled twice) cost
    more than the activation's kernel saves; 3% slower in fp8 again once its tiles folded their
    products (docs/benchmarks/quantization.md)."""

    gated_gemv: bool = False

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        pdl = launches_pdl(self.pdl, x)
        return quantized_linear(x, layer.weight, layer.weight_scale, layer.block_size, layer.bias, pdl=pdl)

    def apply_gated(self, layer, x: torch.Tensor, activation: str) -> torch.Tensor:
        if self.gated_gemv and x.is_cuda and _one_row(layer, x):
            weight, scale, block_size = layer.weight, layer.weight_scale, layer.block_size
            return quantized_gated_gemv(
                x, weight, scale, block_size, layer.bias, activation=activation, pdl=self.pdl
            )
        return super().apply_gated(layer, x, activation)


def _in_weight_order(layer, x: torch.Tensor) -> torch.Tensor:
    """x with its columns gathered in the 4-bit weight's column order (`layer.input_perm`, a GPTQ
    act-order weight's), or x itself."""
    return x if layer.input_perm is None else x.index_select(-1, layer.input_perm)


@dataclass(frozen=True)
class Int4Method(DenseMethod):
    """Packed 4-bit weights (the layout of infer.kernels.gemv.int4_layout) through `int4_linear`. A GPTQ
    act-order weight's columns are stored sorted by group (`layer.input_perm`), so x's columns
    are gathered in that order first. A gate/up projection's one CUDA row and its activation run
    as `int4_gated_gemv` (on tensor cores where gemv.int4_mma runs): with the Triton GEMV at
    9544cf1, Qwen3-8B's W1 on an H200 decoded 387.6 and 387.6 tok/s with it against 372.6 and
    372.1 with the projection's GEMV and the activation's kernel after it
    (docs/benchmarks/quantization.md#gpu-batch-1-decode-h200)."""

    def apply_gated(self, layer, x: torch.Tensor, activation: str) -> torch.Tensor:
        if x.is_cuda and _one_row(layer, x):
            return int4_gated_gemv(
                _in_weight_order(layer, x),
                layer.weight,
                layer.weight_scale,
                layer.weight_zero,
                layer.group_size,
                layer.bias,
                activation=activation,
                pdl=launches_pdl(self.pdl, x),
            )
        return super().apply_gated(layer, x, activation)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(
            _in_weight_order(layer, x),
            layer.weight,
            layer.weight_scale,
            layer.weight_zero,
            layer.group_size,
            layer.bias,
            pdl=launches_pdl(self.pdl, x),
        )


@dataclass(frozen=True)
class CpuInt8Method(DenseMethod):
    """Per-channel int8 weights on a CPU through `int8_linear_cpu`, with the scales it takes
    (made once, at build). `native`: a few rows may take the C kernel."""

    scale: Int8CpuScale | None = None
    native: bool = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return int8_linear_cpu(x, layer.weight, self.scale, layer.bias, native=self.native)


@dataclass(frozen=True)
class CpuBf16Method(DenseMethod):
    """A bf16 weight on a CPU: float32 inputs through `bf16_linear_cpu` (`native`: a few rows may
    take the C kernel), bf16 inputs as `DenseMethod`."""

    native: bool = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().apply(layer, x)
        return bf16_linear_cpu(x, layer.weight, layer.bias, native=self.native)


@dataclass(frozen=True)
class GgufMethod(DenseMethod):
    """A GGUF file's blocks (`layer.gguf_format`) on a CPU through `gguf_linear_cpu`. `native`:
    its C kernel where it builds."""

    native: bool = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return gguf_linear_cpu(x, layer.weight, layer.gguf_format, layer.bias, native=self.native)


@dataclass(frozen=True, eq=False)
class DequantizedGgufMethod(DenseMethod):
    """A GGUF weight where gguf_gemv_cpu.c does not run: its fp32 `weight` [N, K], dequantized
    once at build (`of(layer)`), through `dense_linear`. Dequantizing at every call instead, as
    `gguf_linear_cpu` then does, decoded SmolLM2's Q4_1 file at a quarter of transformers' speed
    (docs/benchmarks/quantization.md#cpu-without-a-c-compiler); the price is the fp32 copy, 6.4x
    the packed Q4_1 bytes, beside them."""

    weight: torch.Tensor | None = None

    @classmethod
    def of(cls, layer) -> "DequantizedGgufMethod":
        return cls(weight=dequantize_gguf(layer.weight.data, layer.gguf_format))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x.to(self.weight.dtype), self.weight, layer.bias).to(x.dtype)
