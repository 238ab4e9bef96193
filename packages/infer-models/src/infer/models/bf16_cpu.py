"""bf16 weights under float32 activations on a CPU: what `--device cpu --dtype bfloat16` runs
where infer.kernels' C kernels build.

A CPU decode step is bound by reading the weights, and bf16 reads half of fp32's bytes; but ATen's
bf16 products of a row read at about 25 GB/s on the CI-class VM and the C decoder stack takes
float32 activations and caches only. So the Linears keep their bf16 weights (and a tied LM head
its bf16 table), which bf16_gemv_cpu.c widens to fp32 in registers (`CpuBf16Method` for the
PyTorch path, the stack's bf16 Linears for decode steps), and everything else is float32: the
embedding's rows as they are looked up, the norms, the biases, so the activations and the KV cache
(the model's dtype) too. The arithmetic is then the fp32 model's on the bf16-rounded weights.
"""

import torch
from torch import nn

from infer.kernels import bf16_linear_cpu_native
from infer.models.common import Embedding
from infer.models.linear import Linear


def takes_fp32_activations(model: nn.Module, device: torch.device, use_native_cpu_kernels: bool) -> bool:
    """Whether `model` (loaded) runs bf16 weights under float32 activations: a dense bf16 model on
    a CPU, the C kernels allowed and built here, not a tensor-parallel shard, no vision tower."""
    return (
        torch.device(device).type == "cpu"
        and use_native_cpu_kernels
        and model.dtype == torch.bfloat16
        and model.quantization is None
        and model.tp is None
        and model.vision is None
        and bf16_linear_cpu_native()
    )


def widen_activations(model: nn.Module) -> None:
    """Makes `model`'s activations float32 in place: the Linears' and the embedding's bf16 weights
    stay, every other parameter (norms, biases) becomes float32, lookups widen to float32."""
    for module in model.modules():
        if isinstance(module, Embedding):
            module.activation_dtype = torch.float32
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if isinstance(module, Linear) and name == "weight":
                continue
            parameter.data = parameter.data.float()
