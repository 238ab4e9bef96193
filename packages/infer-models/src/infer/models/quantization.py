"""Weight-only 8-bit and 4-bit quantization: the checkpoint formats we read, and quantizing at load.

A quantized Linear stores an 8-bit `weight` [out, in] and a float32 `weight_scale` with one scale
per block of `block_size = (rows, cols)` weights: W[n, k] = weight[n, k] * scale[n // rows, k // cols].
Activations stay in the model's dtype (w8a16): decode reads the weights, so one byte per weight
instead of two is what makes it faster, and 8B models fit in 16 GB.

The formats of published checkpoints (`quantization_config` in config.json):
- FP8 block-wise (`quant_method: "fp8"`, `weight_block_size: [128, 128]`; Qwen3-8B-FP8,
  DeepSeek-V3): float8_e4m3fn weights, a float32 `weight_scale_inv` per 128x128 block (the
  partial last block of a dimension that is not a multiple of 128 has its own scale). Despite its
  name it multiplies: W = weight * weight_scale_inv.
- INT8 per output channel (`quant_method: "compressed-tensors"`, int weights of 8 bits,
  symmetric, strategy "channel"; nytopop/Qwen3-8B.w8a8): int8 weights and a `weight_scale`
  [out, 1]. Its activations are quantized per token at run time by the engines it was made for;
  we run it weight-only (the issue allows it), so `input_scale` tensors, if any, are not read.
In both, the attention and MLP projections are quantized; embeddings, norms and the LM head are
stored in the model's dtype.

`quantization="int8"` (or "fp8") on an unquantized checkpoint quantizes at load instead, every
Linear including the LM head (a separate 8-bit copy when it shares the embedding, whose lookup
keeps the full table): per output channel for int8, 128x128 blocks for fp8, scales absmax / qmax.

4-bit weights (w4a16, the layout of infer.kernels.gemv.int4_layout; infer.models.int4_weights repacks and
quantizes them) come from two published formats, read as they are stored and repacked at load:
- GPTQ (`quant_method: "gptq"`, bits 4; GPTQModel, AutoGPTQ): a `group_size` (-1: one group a
  row), `sym` (symmetric: every zero point 8), `desc_act` (act-order: a `g_idx` that permutes the
  columns into groups) and `checkpoint_format` "gptq" (v1, the zero points stored minus 1) or
  "gptq_v2" (as they are).
- AWQ (`quant_method: "awq"`, AutoAWQ's `version: "gemm"` with `zero_point: true`).
Both keep embeddings, norms and the LM head in the model's dtype, and so does
`quantization="int4"`, which quantizes a dense checkpoint's attention and MLP projections at load
(round to nearest, groups of 128 columns, a zero point per group).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# What `quantization=` may ask for at load (int4: on a dense checkpoint, or a 4-bit one as stored).
QUANTIZATION_METHODS = ("fp8", "int8", "int4")
# The 4-bit formats: two of checkpoints, and "int4", quantized at load.
INT4_METHODS = ("gptq", "awq", "int4")
# Columns per scale when we quantize at load or write a 4-bit checkpoint (GPTQ's and AWQ's usual).
INT4_GROUP = 128
# The smallest group `int4_group_for` falls back to where a Linear's inputs are not a multiple of 128.
INT4_MIN_GROUP = 16
# Not a format of this module: the weights of the GGUF file an alias's folder was converted from,
# run in its own blocks (infer.models.loader.gguf_weights). What `--quantization` takes is either.
GGUF_QUANTIZATION = "gguf"
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, GGUF_QUANTIZATION)
WEIGHT_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# The largest magnitude each 8-bit format holds: a block's absmax maps onto it.
QMAX = {"fp8": torch.finfo(torch.float8_e4m3fn).max, "int8": 127.0}
# safetensors' names for the 8-bit dtypes, to check a checkpoint's tensors before reading them.
SAFETENSORS_DTYPES = {"fp8": "F8_E4M3", "int8": "I8"}
FP8_BLOCK = (128, 128)
# The scale block each format has when we write or quantize it ourselves (None: one per row).
DEFAULT_BLOCKS = {"fp8": FP8_BLOCK, "int8": None}
# Checkpoint name (last component) of a weight's scale tensor in each format.
SCALE_NAMES = {"fp8": "weight_scale_inv", "int8": "weight_scale"}


@dataclass(frozen=True)
class Quantization:
    """How a model's Linear weights are stored."""

    method: str  # "fp8" or "int8"
    # Weights per scale, (rows, cols); None: one scale per output row over all its inputs.
    block_size: tuple[int, int] | None
    # True: the checkpoint stores 8-bit weights and scales; False: quantized as they are loaded.
    in_checkpoint: bool = True
    # Modules the checkpoint leaves unquantized (its ignore list), by name without the decoder prefix.
    ignored: tuple[str, ...] = ()
    # 4-bit: columns per scale (None: one group a row, GPTQ's -1); symmetric: no zero points
    # stored in our layout (GPTQ's sym, every zero 8); act_order: GPTQ's desc_act, a column
    # permutation per Linear; zero_offset: what the checkpoint's stored zero points lack (1 in
    # GPTQ's v1 format).
    group_size: int | None = None
    symmetric: bool = False
    act_order: bool = False
    zero_offset: int = 0

    @property
    def is_int4(self) -> bool:
        return self.method in INT4_METHODS

    @property
    def weight_dtype(self) -> torch.dtype:
        return WEIGHT_DTYPES[self.method]

    @property
    def scale_name(self) -> str:
        return SCALE_NAMES[self.method]

    def block_for(self, in_features: int) -> tuple[int, int]:
        """The concrete block of a Linear with `in_features` inputs (per channel: one row, all inputs)."""
        return self.block_size or (1, in_features)

    def quantizes(self, module_name: str) -> bool:
        """Whether the Linear called `module_name` ("layers.0.mlp.down_proj", "lm_head") is quantized."""
        if module_name == "lm_head":
            return not self.in_checkpoint and not self.is_int4
        return not any(module_name == i or module_name.endswith("." + i) for i in self.ignored)


class QuantizationConfigError(ValueError):
    """A `quantization_config` we do not read, or a requested quantization the checkpoint can't give."""


def parse_quantization_config(raw: dict | None) -> Quantization | None:
    """The Quantization of a config.json's `quantization_config` (None when it has none)."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "fp8":
        block = raw.get("weight_block_size")
        if not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise QuantizationConfigError(
                f"quantization_config: fp8 needs weight_block_size [rows, cols] (block-wise scales); "
                f"got {block!r} (per-tensor fp8 is not supported)"
            )
        ignored = tuple(raw.get("modules_to_not_convert") or ())
        return Quantization("fp8", tuple(block), ignored=_strip_ignored(ignored))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "gptq":
        return _parse_gptq(raw)
    if method == "awq":
        return _parse_awq(raw)
    raise QuantizationConfigError(
        f"quantization_config: quant_method {method!r} is not supported; supported: fp8 (block-wise), "
        "compressed-tensors (int8 per channel), gptq and awq (4-bit)"
    )


def _int4_group(raw: dict) -> int | None:
    if raw.get("bits") != 4:
        raise QuantizationConfigError(
            f"quantization_config: {raw['quant_method']} is supported with bits 4, got {raw.get('bits')!r}"
        )
    group = raw.get("group_size")
    if group == -1:
        return None
    if isinstance(group, bool) or not isinstance(group, int) or group < 2 or group % 2:
        raise QuantizationConfigError(
            f"quantization_config: group_size must be -1 or an even number of columns, got {group!r}"
        )
    return group


def _parse_gptq(raw: dict) -> Quantization:
    group = _int4_group(raw)
    checkpoint_format = raw.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationConfigError(
            f"quantization_config: gptq checkpoint_format {checkpoint_format!r} is not supported "
            "(gptq, gptq_v2; marlin and other repacked formats are not)"
        )
    if raw.get("lm_head"):
        raise QuantizationConfigError(
            "quantization_config: a 4-bit LM head (gptq lm_head: true) is not supported"
        )
    return Quantization(
        "gptq",
        None,
        ignored=_strip_ignored(tuple(raw.get("modules_to_not_convert") or ())),
        group_size=group,
        symmetric=bool(raw.get("sym", True)),
        act_order=bool(raw.get("desc_act", False)),
        zero_offset=1 if checkpoint_format == "gptq" else 0,
    )


def _parse_awq(raw: dict) -> Quantization:
    group = _int4_group(raw)
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm" or raw.get("zero_point", True) is not True:
        raise QuantizationConfigError(
            "quantization_config: awq is supported as version 'gemm' with zero_point true, got "
            f"version {raw.get('version')!r}, zero_point {raw.get('zero_point')!r}"
        )
    ignored = tuple(raw.get("modules_to_not_convert") or ())
    return Quantization("awq", None, ignored=_strip_ignored(ignored), group_size=group)


def _parse_compressed_tensors(raw: dict) -> Quantization:
    groups = raw.get("config_groups") or {}
    weights = [group.get("weights") or {} for group in groups.values()]
    wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    if len(weights) != 1 or any(weights[0].get(key) != value for key, value in wanted.items()):
        raise QuantizationConfigError(
            "quantization_config: compressed-tensors is supported with one config group of 8-bit "
            f"symmetric int weights, strategy 'channel'; got weights {weights}"
        )
    if raw.get("format") not in (None, "int-quantized", "naive-quantized"):
        raise QuantizationConfigError(
            f"quantization_config: compressed-tensors format {raw.get('format')!r} is not supported "
            "(int-quantized: int8 tensors as stored)"
        )
    return Quantization("int8", None, ignored=_strip_ignored(tuple(raw.get("ignore") or ())))


def _strip_ignored(names: tuple[str, ...]) -> tuple[str, ...]:
    # Checkpoints name modules with the decoder prefix ("model.layers.0.mlp"); ours have none.
    # "re:" patterns (compressed-tensors) other than the LM head's are refused rather than guessed.
    stripped = []
    for name in names:
        if name == "lm_head":
            continue
        if name.startswith("re:"):
            raise QuantizationConfigError(f"quantization_config: ignore pattern {name!r} is not supported")
        stripped.append(name.removeprefix("model."))
    return tuple(stripped)


def resolve_quantization(in_checkpoint: Quantization | None, requested: str | None) -> Quantization | None:
    """What the model runs: the checkpoint's format, or `requested` applied at load to an
    unquantized checkpoint. Asking a quantized checkpoint for another format is an error."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise QuantizationConfigError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got {requested!r}"
        )
    if in_checkpoint is not None:
        # "int4" asks for 4-bit weights, which a GPTQ or AWQ checkpoint gives as stored.
        if requested not in (None, in_checkpoint.method) and not (
            requested == "int4" and in_checkpoint.is_int4
        ):
            raise QuantizationConfigError(
                f"the checkpoint's weights are {in_checkpoint.method}; it cannot be loaded as {requested} "
                f"(leave quantization unset, or set it to {in_checkpoint.method})"
            )
        return in_checkpoint
    if requested is None:
        return None
    if requested == "int4":
        return Quantization("int4", None, in_checkpoint=False, group_size=INT4_GROUP)
    return Quantization(requested, DEFAULT_BLOCKS[requested], in_checkpoint=False)


def int4_group_for(quantization: Quantization, in_features: int, module_name: str) -> int:
    """The group of a 4-bit Linear with `in_features` inputs: the checkpoint's (all of a row for
    GPTQ's -1). Quantizing at load, where `in_features` is not a multiple of 128 (SmolLM2's 576),
    the largest power of two below 128 that divides it (64 there), at least INT4_MIN_GROUP: a
    smaller group is a finer scale, never a coarser one."""
    group = quantization.group_size or in_features
    if not quantization.in_checkpoint:
        while in_features % group and group > INT4_MIN_GROUP:
            group //= 2
    if in_features % group or group % 2:
        raise QuantizationConfigError(
            f"{module_name}: {in_features} inputs are not a whole number of {quantization.method} groups "
            f"of {group} columns (4-bit groups must be even and divide the inputs)"
        )
    return group


def scale_shape(out_features: int, in_features: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of an [out, in] weight with one scale per `block_size` block
    (a partial last block of either dimension has its own)."""
    rows, cols = block_size
    return math.ceil(out_features / rows), math.ceil(in_features / cols)


# The float32 bytes of the block rows a weight is quantized at a time: its temporaries (a padded
# float32 copy, the scaled blocks) stay a few times this, not a few times the whole weight, so
# quantizing at load peaks near the final footprint (an LM head of 151936 x 4096 in bf16 made
# 2.3 GiB temporaries at once, issue 55; docs/benchmarks/quantization.md#quantizing-at-load).
QUANTIZE_CHUNK_BYTES = 64 * 2**20


def row_chunks(num_rows: int, bytes_per_row: int) -> list[tuple[int, int]]:
    """(first, last + 1) of each run of rows of at most QUANTIZE_CHUNK_BYTES (one row at least)."""
    step = max(1, QUANTIZE_CHUNK_BYTES // max(1, bytes_per_row))
    return [(first, min(num_rows, first + step)) for first in range(0, num_rows, step)]


def quantize_weight(
    weight: torch.Tensor, method: str, block_size: tuple[int, int], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, float32 scales) of a dense [out, in] weight, symmetric, one scale per block:
    scale = absmax / QMAX (1 for an all-zero block), weight = round(W / scale) for int8, W / scale
    rounded to the nearest float8_e4m3fn for fp8. Whole rows of blocks at a time
    (QUANTIZE_CHUNK_BYTES), each independent of the others, so the result is the same. The result
    is on `device` (default: the weight's); a weight elsewhere (the loader's, on the host) goes
    there a chunk at a time, so the device never holds it dense."""
    device = weight.device if device is None else torch.device(device)
    rows, cols = block_size
    out_features, in_features = weight.shape
    grid = scale_shape(out_features, in_features, block_size)
    quantized = torch.empty(
        weight.shape, dtype=torch.int8 if method == "int8" else torch.float8_e4m3fn, device=device
    )
    scale = torch.empty(grid, dtype=torch.float32, device=device)
    for first, last in row_chunks(grid[0], rows * grid[1] * cols * 4):
        chunk = weight[first * rows : min(last * rows, out_features)].to(device)
        quantized[first * rows : first * rows + chunk.shape[0]], scale[first:last] = _quantize_rows(
            chunk, method, block_size
        )
    return quantized, scale


def _quantize_rows(
    weight: torch.Tensor, method: str, block_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight of rows that start at a block boundary."""
    rows, cols = block_size
    out_features, in_features = weight.shape
    grid = scale_shape(out_features, in_features, block_size)
    # Padded with zeros to whole blocks (they change no block's absmax), viewed block by block.
    padded = F.pad(weight.float(), (0, grid[1] * cols - in_features, 0, grid[0] * rows - out_features))
    blocks = padded.view(grid[0], rows, grid[1], cols)
    absmax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(absmax > 0, absmax / QMAX[method], torch.ones_like(absmax))
    scaled = (blocks / scale[:, None, :, None]).view(grid[0] * rows, grid[1] * cols)
    scaled = scaled[:out_features, :in_features]
    if method == "int8":
        return scaled.round().clamp(-127, 127).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn), scale
