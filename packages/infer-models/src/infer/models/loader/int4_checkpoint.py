"""Loading a 4-bit Linear from a GPTQ or AWQ checkpoint: which tensors it reads, their shapes,
and their repacking (infer.models.int4_weights) into its parameters.

A 4-bit Linear's `weight`, `weight_scale`, `weight_zero` and `input_perm` come together from each
of its parts' `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`), repacked one part at a time on
the device and concatenated by rows (q | k | v, gate | up), as the 8-bit path concatenates. The
parts of a fused act-order Linear share one input and so one column order: GPTQ derives it from
that input, and a checkpoint whose parts disagree is refused.
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from infer.models.config import ModelConfig
from infer.models.int4_weights import PACK_FACTOR, Int4FormatError, repack_awq, repack_gptq
from infer.models.quantization import Quantization
from infer.models.weight_map import weight_source

# safetensors dtypes of the packed tensors and of the scales.
PACKED_DTYPE = "I32"
SCALE_DTYPES = ("F16", "BF16", "F32")
# A 4-bit Linear's parameters, all filled from the checkpoint's packed tensors.
INT4_PARAMETERS = ("weight", "weight_scale", "weight_zero", "input_perm")


@dataclass(frozen=True)
class Int4Source:
    module_name: str  # ours: "layers.0.self_attn.qkv_proj"
    parts: tuple[str, ...]  # the checkpoint's Linears fused into it: "model.layers.0.self_attn.q_proj", ...
    rows: tuple[int, ...]  # output rows of each part
    in_features: int
    group_size: int


def int4_source(module_name: str, module, config: ModelConfig, prefix: str) -> Int4Source:
    weights = weight_source(f"{module_name}.weight", module.out_features, config, prefix)
    parts = tuple(name.removesuffix(".weight") for name in weights.checkpoint_names)
    return Int4Source(module_name, parts, weights.rows, module.in_features, module.group_size)


def expected_tensors(
    source: Int4Source, quantization: Quantization
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Checkpoint tensor -> (shape, accepted dtypes) that `source` reads (GPTQ's g_idx only with
    act-order: without, published checkpoints store the identity or nothing)."""
    k, groups = source.in_features, source.in_features // source.group_size
    expected = {}
    for part, n in zip(source.parts, source.rows, strict=True):
        if quantization.method == "gptq":
            expected[f"{part}.qweight"] = ((k // PACK_FACTOR, n), (PACKED_DTYPE,))
        else:
            expected[f"{part}.qweight"] = ((k, n // PACK_FACTOR), (PACKED_DTYPE,))
        expected[f"{part}.qzeros"] = ((groups, n // PACK_FACTOR), (PACKED_DTYPE,))
        expected[f"{part}.scales"] = ((groups, n), SCALE_DTYPES)
        if quantization.method == "gptq" and quantization.act_order:
            expected[f"{part}.g_idx"] = ((k,), (PACKED_DTYPE,))
    return expected


def optional_tensors(source: Int4Source) -> tuple[str, ...]:
    """Tensors a checkpoint may store beside `source`'s: GPTQ's g_idx without act-order (read
    where present, and then it must put the columns in order)."""
    return tuple(f"{part}.g_idx" for part in source.parts)


def load_int4_linear(
    module: nn.Module,
    source: Int4Source,
    quantization: Quantization,
    read: Callable[[str], torch.Tensor],
    stored: Collection[str],
    device: torch.device | str,
) -> None:
    """Fills `module`'s 4-bit parameters from the checkpoint tensors `read` returns (`stored`:
    the checkpoint's tensor names). Raises Int4FormatError for tensors that are not what the
    format says."""
    repacked = []
    for part in source.parts:
        what = f"{part} ({quantization.method})"
        qweight, qzeros = read(f"{part}.qweight").to(device), read(f"{part}.qzeros").to(device)
        scales = read(f"{part}.scales").to(device, module.weight_scale.dtype)
        if quantization.method == "awq":
            repacked.append(repack_awq(qweight, qzeros, scales, what=what))
            continue
        g_idx = read(f"{part}.g_idx").to(device) if f"{part}.g_idx" in stored else None
        weight = repack_gptq(
            qweight,
            qzeros,
            scales,
            g_idx,
            source.group_size,
            zero_offset=quantization.zero_offset,
            symmetric=quantization.symmetric,
            what=what,
        )
        if weight.perm is not None and module.input_perm is None:
            raise Int4FormatError(f"{what}: g_idx permutes the columns, but desc_act (act-order) is false")
        repacked.append(weight)
    perms = [r.perm for r in repacked]
    if any(
        (p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0])) for p in perms
    ):
        raise Int4FormatError(
            f"{', '.join(source.parts)}: act-order column orders (g_idx) differ between the parts of "
            f"{source.module_name}, which share one input"
        )

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)

    module.weight = nn.Parameter(cat([r.qweight for r in repacked]), requires_grad=False)
    module.weight_scale = nn.Parameter(cat([r.scales for r in repacked]), requires_grad=False)
    if module.weight_zero is not None:
        module.weight_zero = nn.Parameter(cat([r.zeros for r in repacked]), requires_grad=False)
    # The columns in order already (no act-order, or g_idx sorted): no gather at run time.
    module.input_perm = None if perms[0] is None else nn.Parameter(perms[0], requires_grad=False)
