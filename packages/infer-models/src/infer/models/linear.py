"""Linear layers: `x @ weight.T + bias`, dense or with 8-bit weights, and the one CPU path that
needs care.

A Linear's weight is dense (the model's dtype) or 8-bit with block scales (see
infer.models.quantization); `quantize` turns a dense Linear, still on the meta device, into an
8-bit one before the loader fills it. Both formats run through one op, `quantized_linear`,
whose block size covers per-channel int8 and block-wise fp8 alike.

On a CPU, fp32 `F.linear` of a few rows is a BLAS matrix-vector product, which the bundled MKL
runs on one thread: on the CI-class 2-core machine it reads a weight that is not in cache at
~15 GB/s of the ~40 GB/s the machine gives, and a decode step is nothing but such products
(SmolLM2's decode spent 32 of its 45 ms a token in them). `dense_linear` splits the weight's
rows into `CPU_SPLIT` parts and runs them as one batched product, which torch spreads over its
threads: the same arithmetic for each output (one row of the weight against x), at ~38 GB/s.
Larger inputs (prefill chunks), other dtypes (bf16's `F.linear` reads at ~25 GB/s there, its
batched product at ~14) and other devices keep `F.linear`.

On a GPU, inside `triton_gemv()` (EngineConfig.use_triton_gemv), a dense Linear sends its one-row
inputs (batch-1 decode) to infer.kernels' Triton GEMV instead of cuBLAS: faster at the 1-2B
models' widths, and a kernel that programmatic dependent launch overlaps with its neighbours.
A gated MLP's gate/up projection then takes `gated_gemv`, its activation in the same kernel;
an int8 one always does (`quantized_gated_gemv`), its one-row product being that GEMV anyway.
A projection after a pre-norm of a row of at most 2048 values takes `normed_gemv`, the norm in
the same kernel (`RMSNorm.project`); a dense gate/up projection takes `normed_gated_gemv` where its
grid is one wave (`GatedMLP.after_norm`).

On a CPU, per-channel int8 weights run `int8_linear_cpu`: a few rows through infer.kernels' AVX2
kernel where `native_cpu_kernels()` allows it (EngineConfig.use_native_cpu_kernels).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels import (
    gated_gemv,
    gemv,
    int8_cpu_scale,
    int8_linear_cpu,
    int8_linear_cpu_supports,
    normed_gated_gemv_fills_one_wave,
    quantized_gated_gemv,
    quantized_linear,
)
from infer.kernels.normed_gemv import MAX_K as NORMED_GEMV_MAX_K
from infer.models.quantization import Quantization, scale_shape

# At most this many rows take the split path: measured on the 2-core CI machine, the batched
# product reads at 35-38 GB/s up to 4 rows and falls to F.linear's speed from 8.
CPU_SPLIT_MAX_ROWS = 4
CPU_SPLIT = 8  # parts of the weight's rows: more than the threads, so that they share the work evenly

_triton_gemv = False


@contextlib.contextmanager
def triton_gemv(enabled: bool = True):
    """Inside, dense Linears send one-row CUDA inputs to infer.kernels.gemv. A context, not a
    model setting, so that engines sharing a model (tests) each run their own choice; CUDA
    graphs captured inside keep it."""
    global _triton_gemv
    previous, _triton_gemv = _triton_gemv, enabled
    try:
        yield
    finally:
        _triton_gemv = previous


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


class Linear(nn.Module):
    """`x @ weight.T + bias` with uninitialised parameters: every weight comes from a checkpoint,
    and skipping nn.Linear's random init keeps building a model on the meta device instant."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, output_sizes: tuple[int, ...] = ()
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The rows of each checkpoint tensor fused into this one (q, k, v), in order.
        self.output_sizes = output_sizes or (out_features,)
        if sum(self.output_sizes) != out_features:
            raise ValueError(f"output_sizes {output_sizes} do not add up to out_features {out_features}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # 8-bit weights: float32 scales, one per block of `block_size` weights (None: dense).
        self.weight_scale: nn.Parameter | None = None
        self.block_size: tuple[int, int] | None = None
        # On a CPU: the scales as int8_linear_cpu takes them, made at the first call (False: this
        # weight is not for it; None: not looked at yet).
        self._cpu_int8_scale: torch.Tensor | bool | None = None

    def quantize(self, weight_dtype: torch.dtype, block_size: tuple[int, int]) -> None:
        """Makes this Linear's weight 8-bit (`weight_dtype`) with a scale per `block_size` block:
        new, empty parameters on the weight's device, for the loader to fill."""
        device = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=weight_dtype, device=device),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(
            torch.empty(
                scale_shape(self.out_features, self.in_features, block_size),
                dtype=torch.float32,
                device=device,
            ),
            requires_grad=False,
        )
        self.block_size = block_size

    def takes_triton_gemv(self, x: torch.Tensor) -> bool:
        """Whether `x` goes to infer.kernels' GEMV: a dense weight, one CUDA row, inside `triton_gemv()`."""
        return _triton_gemv and self.weight_scale is None and self._one_cuda_row(x)

    def _one_cuda_row(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() == self.in_features

    def takes_gated_gemv(self, x: torch.Tensor) -> bool:
        """Whether a gated MLP's gate/up projection of `x` and its activation run as one kernel:
        one CUDA row, on the Triton GEMV: dense weights inside `triton_gemv()`, int8 ones always
        (their one-row product is that GEMV anyway), fp8 ones never. On an H100, Qwen3-8B's batch-1
        decode ran 2% faster in int8 and 5% slower in fp8, whose gated tiles (twice the plain
        one's rows, each column scaled twice) cost more than the activation's kernel saves; 3%
        slower in fp8 again once its tiles folded their products (docs/benchmarks/quantization.md)."""
        if self.weight_scale is None:
            return self.takes_triton_gemv(x)
        return self.weight.dtype == torch.int8 and self._one_cuda_row(x)

    def takes_normed_gemv(self, x: torch.Tensor) -> bool:
        """Whether a norm of `x` and this projection of it run as one kernel (`normed_gemv`): on
        the Triton GEMV, with no bias, for a row that one weight tile spans."""
        return self.bias is None and self.in_features <= NORMED_GEMV_MAX_K and self.takes_triton_gemv(x)

    def takes_normed_gated_gemv(self, x: torch.Tensor) -> bool:
        """Whether a norm of `x`, this gate/up projection of it and the activation run as one kernel
        (`normed_gated_gemv`): a dense weight that takes the normed GEMV, where the kernel's grid is
        one wave (where it was faster than the norm's kernel and the gated GEMV)."""
        return self.takes_normed_gemv(x) and normed_gated_gemv_fills_one_wave(self.out_features, x.device)

    def gated_gemv(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """`act(gate) * up` of this gate/up projection of one row, where `takes_gated_gemv(x)`."""
        if self.weight_scale is None:
            return gated_gemv(x, self.weight, self.bias, activation=activation)
        scale, block_size = self.weight_scale, self.block_size
        return quantized_gated_gemv(x, self.weight, scale, block_size, self.bias, activation=activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            if self.takes_triton_gemv(x):
                return gemv(x, self.weight, self.bias)
            return dense_linear(x, self.weight, self.bias)
        if x.device.type == "cpu":
            if self._cpu_int8_scale is None:
                per_channel = self.block_size == (1, self.in_features)
                usable = per_channel and int8_linear_cpu_supports(self.weight)
                self._cpu_int8_scale = int8_cpu_scale(self.weight_scale) if usable else False
            if self._cpu_int8_scale is not False:
                return int8_linear_cpu(x, self.weight, self._cpu_int8_scale, self.bias)
        return quantized_linear(x, self.weight, self.weight_scale, self.block_size, self.bias)

    def extra_repr(self) -> str:
        quantized = f", {self.weight.dtype}, block_size={self.block_size}" if self.block_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{quantized}"


def quantize_linears(model: nn.Module, quantization: Quantization) -> None:
    """Makes every Linear of `model` that `quantization` covers 8-bit, before its weights load.

    A fused Linear takes its parts' scales concatenated, which lines their blocks up only when
    every part but the last fills whole blocks of rows; otherwise (SmolLM2's k and v, 192 rows
    each, in 128-row fp8 blocks) it keeps one scale row per weight row and the loader repeats each
    stored scale row over the rows of its block.
    """
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not quantization.quantizes(name):
            continue
        rows, cols = quantization.block_for(module.in_features)
        if quantization.in_checkpoint and any(size % rows for size in module.output_sizes[:-1]):
            rows = 1
        module.quantize(quantization.weight_dtype, (rows, cols))
