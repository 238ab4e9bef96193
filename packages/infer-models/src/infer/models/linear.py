"""Linear layers: `x @ weight.T + bias`, dense or with 8-bit or 4-bit weights, computed by the
method the kernel policy picked for them (infer.models.linear_method).

A Linear's weight is dense (the model's dtype), 8-bit with block scales (see
infer.models.quantization), 4-bit packed with group scales and zero points
(the layout of infer.kernels.gemv.int4_layout), or a GGUF file's blocks (`gguf_format`, `pack_gguf`);
`quantize` and `quantize_int4` turn a dense Linear, still on the meta device, into an 8-bit or
4-bit one before the loader fills it. Until `apply_kernel_policy` picks otherwise, a dense Linear
runs `DenseMethod` (ATen), an 8-bit one `QuantizedMethod` (`quantized_linear`, whose block size
covers per-channel int8 and block-wise fp8 alike) and a 4-bit one `Int4Method` (`int4_linear`),
all right on any device, and a GGUF one `GgufMethod` (CPU).
"""

import torch
from torch import nn

from infer.kernels import gguf_row_bytes
from infer.models.linear_method import DenseMethod, GgufMethod, Int4Method, LinearMethod, QuantizedMethod
from infer.models.quantization import Quantization, int4_group_for, scale_shape


def empty_gguf_weight(rows: int, cols: int, fmt: str, device: torch.device) -> nn.Parameter:
    """An empty parameter for a [rows, cols] weight in GGUF blocks of `fmt`, uint8 [rows, cols / 32
    * block bytes], for the loader to fill (a Linear's or an embedding table's)."""
    shape = (rows, gguf_row_bytes(fmt, cols))
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device), requires_grad=False)


class Linear(nn.Module):
    """`x @ weight.T + bias` with uninitialised parameters: every weight comes from a checkpoint,
    and skipping nn.Linear's random init keeps building a model on the meta device instant."""

    # Tensor parallelism (infer.models.tensor_parallel): which part of the checkpoint's weight
    # this rank holds, and for a row-parallel Linear the ranks whose partial sums add up.
    tp_shard = None
    tp_reduce = None

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
        # 4-bit weights (`weight` packed uint8 [out, in / 2]): columns per scale, uint8 zero
        # points per group (None: symmetric) and the input's column order (GPTQ act-order; None:
        # as they are). group_size None: not 4-bit.
        self.group_size: int | None = None
        self.weight_zero: nn.Parameter | None = None
        self.input_perm: nn.Parameter | None = None
        # A GGUF block format ("q4_1", infer.kernels' GGUF_FORMATS) where the weight is kept in the
        # file's blocks, uint8 [out, in / 32 * block bytes] (infer.models.loader.gguf_weights).
        self.gguf_format: str | None = None
        # How forward computes: picked by the kernel policy (infer.models.kernel_policy).
        self.method: LinearMethod = DenseMethod()

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
        self.method = QuantizedMethod()

    def quantize_int4(
        self, group_size: int, *, symmetric: bool, scale_dtype: torch.dtype, act_order: bool
    ) -> None:
        """Makes this Linear's weight 4-bit in groups of `group_size` columns: new, empty
        parameters on the weight's device for the loader to fill (`symmetric`: no zero points;
        `act_order`: a column order, which the loader drops where the columns are in order)."""
        device, groups = self.weight.device, self.in_features // group_size

        def empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.weight = empty(self.out_features, self.in_features // 2, dtype=torch.uint8)
        self.weight_scale = empty(self.out_features, groups, dtype=scale_dtype)
        self.weight_zero = None if symmetric else empty(self.out_features, groups, dtype=torch.uint8)
        self.input_perm = empty(self.in_features, dtype=torch.int64) if act_order else None
        self.group_size = group_size
        self.method = Int4Method()

    def pack_gguf(self, fmt: str) -> None:
        """Makes this Linear's weight GGUF blocks of `fmt`: a new, empty uint8 parameter on the
        weight's device, for the loader to fill."""
        self.weight = empty_gguf_weight(self.out_features, self.in_features, fmt, self.weight.device)
        self.gguf_format = fmt
        self.method = GgufMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return out if self.tp_reduce is None else self.tp_reduce.all_reduce(out)

    def gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """`act(gate) * up` of this gate/up projection of `x` (`activation`: "silu" or "gelu_tanh")."""
        return self.method.apply_gated(self, x, activation)

    def extra_repr(self) -> str:
        quantized = f", {self.weight.dtype}, block_size={self.block_size}" if self.block_size else ""
        if self.group_size is not None:
            quantized = f", int4, group_size={self.group_size}"
        if self.gguf_format is not None:
            quantized = f", gguf {self.gguf_format}"
        return f"in_features={self.in_features}, out_features={self.out_features}{quantized}"


def quantize_linears(model: nn.Module, quantization: Quantization) -> None:
    """Makes every Linear of `model` that `quantization` covers 8-bit or 4-bit, before its
    weights load.

    4-bit scales keep the checkpoint's float16 (GPTQ and AWQ store them so: exact, and half the
    bytes of float32) or, quantized at load, the model's dtype. A fused 4-bit Linear's parts
    concatenate by rows, their groups lining up as every part has the same inputs.

    A fused Linear takes its parts' scales concatenated, which lines their blocks up only when
    every part but the last fills whole blocks of rows; otherwise (SmolLM2's k and v, 192 rows
    each, in 128-row fp8 blocks) it keeps one scale row per weight row and the loader repeats each
    stored scale row over the rows of its block.
    """
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not quantization.quantizes(name):
            continue
        if quantization.is_int4:
            module.quantize_int4(
                int4_group_for(quantization, module.in_features, name),
                symmetric=quantization.symmetric,
                scale_dtype=torch.float16 if quantization.in_checkpoint else module.weight.dtype,
                act_order=quantization.act_order,
            )
            continue
        rows, cols = quantization.block_for(module.in_features)
        if quantization.in_checkpoint and any(size % rows for size in module.output_sizes[:-1]):
            rows = 1
        module.quantize(quantization.weight_dtype, (rows, cols))
