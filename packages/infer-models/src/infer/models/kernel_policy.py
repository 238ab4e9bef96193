"""The build step: which kernels a loaded model runs, decided once for a device and a config.

`KernelPolicy` holds the choices (the engine makes one from EngineConfig's `use_triton_gemv`,
`use_pdl` and `use_native_cpu_kernels`); `apply_kernel_policy(model, policy)` applies them to a
loaded model, once, before its first forward:
- each Linear gets its method (`policy.linear_method`, infer.models.linear_method);
- each block's pre-norm projections (infer.models.prenorm) become one kernel
  (`NormedGemvProjection`) where the policy and the weights allow it;
- the modules that launch Triton kernels get the launch options: `pdl` (programmatic dependent
  launch for one-row inputs) and, on attention, `native_cpu_kernels`.
`forward` then never asks which kernel to run. Applying another policy to the same model
replaces every choice. load_causal_lm applies `KernelPolicy(device)`, the plain ATen paths.

PDL for one-row inputs: a batch-1 decode step's kernels are one short wave each, whose launch
and start-up PDL hides; longer inputs' kernels are multi-wave, where PDL cost up to 1.37x on an
H100 (docs/benchmarks/generation.md#pdl, from experiments/pdl_decode_chain.py).
"""

from dataclasses import dataclass

import torch
from torch import nn

from infer.kernels import (
    gguf_linear_cpu_native,
    int8_cpu_scale,
    int8_linear_cpu_supports,
    normed_gated_gemv_fills_one_wave,
)
from infer.kernels.gemv.configs import NORMED_MAX_K
from infer.models.common import Attention, RMSNorm
from infer.models.linear import Linear
from infer.models.linear_method import (
    CpuBf16Method,
    CpuInt8Method,
    DenseMethod,
    DequantizedGgufMethod,
    GgufMethod,
    Int4Method,
    LinearMethod,
    QuantizedMethod,
    TritonGemvMethod,
)
from infer.models.prenorm import NormedGemvProjection, PreNormProjection


@dataclass(frozen=True)
class KernelPolicy:
    """`device`: where the model runs. `use_triton_gemv` (CUDA): one-row dense Linears on
    infer.kernels' GEMV, and a pre-norm fused into its projection's kernel. `use_pdl` (CUDA):
    one-row inputs launch with programmatic dependent launch. `use_native_cpu_kernels` (CPU):
    infer.kernels' C kernels for int8 and GGUF Linears and decode attention, and the engine's C
    decoder stack for decode steps; a GGUF weight without its C kernel is dequantized once."""

    device: torch.device
    use_triton_gemv: bool = False
    use_pdl: bool = False
    use_native_cpu_kernels: bool = True

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pdl(self) -> bool:
        """Whether the model's Triton kernels launch (their one-row inputs) with PDL."""
        return self.use_pdl and self.on_cuda

    def linear_method(self, linear: Linear) -> LinearMethod:
        """The method for `linear`'s weight (loaded) on this device."""
        if linear.group_size is not None:
            return Int4Method(pdl=self.pdl)
        if linear.gguf_format is not None:
            if self.device.type != "cpu":
                raise ValueError(f"GGUF block weights run on the CPU only, not on {self.device}")
            if self.use_native_cpu_kernels and gguf_linear_cpu_native():
                return GgufMethod()
            return DequantizedGgufMethod.of(linear)
        if linear.weight_scale is None:
            if self.use_triton_gemv and self.on_cuda:
                return TritonGemvMethod(pdl=self.pdl)
            if self.device.type == "cpu" and linear.weight.dtype == torch.bfloat16:
                return CpuBf16Method(native=self.use_native_cpu_kernels)
            return DenseMethod(pdl=self.pdl)
        int8 = linear.weight.dtype == torch.int8
        if self.device.type == "cpu" and int8 and self._cpu_int8_fits(linear):
            scale = int8_cpu_scale(linear.weight_scale.data)
            return CpuInt8Method(scale=scale, native=self.use_native_cpu_kernels)
        return QuantizedMethod(pdl=self.pdl, gated_gemv=int8)

    def pre_norm_projection(self, unfused: PreNormProjection) -> PreNormProjection:
        """`unfused`, or the one-kernel module where it runs faster: on the Triton GEMV, a dense
        projection without bias of a row one weight tile spans; a gate/up projection where the
        kernel's grid is one wave (where it beat the norm's kernel and the gated GEMV)."""
        norm, proj = unfused.parts
        fuses = (
            self.use_triton_gemv
            and self.on_cuda
            and proj.weight_scale is None
            and proj.bias is None
            and proj.in_features <= NORMED_MAX_K
        )
        if unfused.activation is not None:
            fuses = fuses and normed_gated_gemv_fills_one_wave(proj.out_features, self.device)
        if not fuses:
            return PreNormProjection(norm, proj, activation=unfused.activation)
        return NormedGemvProjection(norm, proj, activation=unfused.activation, pdl=self.pdl)

    @staticmethod
    def _cpu_int8_fits(linear: Linear) -> bool:
        per_channel = linear.block_size == (1, linear.in_features)
        return per_channel and int8_linear_cpu_supports(linear.weight)


def apply_kernel_policy(model: nn.Module, policy: KernelPolicy) -> nn.Module:
    """Applies `policy` to `model` (its weights loaded, on `policy.device`) in place; returns it."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method = policy.linear_method(module)
        elif isinstance(module, RMSNorm):
            module.pdl = policy.pdl
        elif isinstance(module, Attention):
            module.pdl = policy.pdl
            module.native_cpu_kernels = policy.use_native_cpu_kernels
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PreNormProjection):
                setattr(module, name, policy.pre_norm_projection(child))
    return model
