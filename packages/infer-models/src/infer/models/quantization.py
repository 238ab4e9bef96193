"""Weight-only 8-bit quantization: the checkpoint formats we read, and quantizing at load.

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
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANTIZATION_METHODS = ("fp8", "int8")
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
        """Whether the Linear called `module_name` ("layers.0.mlp.down_proj", "lm_head") is 8-bit."""
        if module_name == "lm_head":
            return not self.in_checkpoint
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
    raise QuantizationConfigError(
        f"quantization_config: quant_method {method!r} is not supported; supported: fp8 (block-wise), "
        "compressed-tensors (int8 per channel)"
    )


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
        if requested not in (None, in_checkpoint.method):
            raise QuantizationConfigError(
                f"the checkpoint's weights are {in_checkpoint.method}; it cannot be loaded as {requested} "
                f"(leave quantization unset, or set it to {in_checkpoint.method})"
            )
        return in_checkpoint
    if requested is None:
        return None
    return Quantization(requested, DEFAULT_BLOCKS[requested], in_checkpoint=False)


def scale_shape(out_features: int, in_features: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of an [out, in] weight with one scale per `block_size` block
    (a partial last block of either dimension has its own)."""
    rows, cols = block_size
    return math.ceil(out_features / rows), math.ceil(in_features / cols)


# The float32 bytes of the block rows a weight is quantized at a time: its temporaries (a padded
# float32 copy, the scaled blocks) stay a few times this, not a few times the whole weight, so
# quantizing at load peaks near the final footprint (an LM head of 151936 x 4096 in bf16 made
# 2.3 GiB temporaries at once, issue 55).
QUANTIZE_CHUNK_BYTES = 64 * 2**20


def quantize_weight(
    weight: torch.Tensor, method: str, block_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, float32 scales) of a dense [out, in] weight, symmetric, one scale per block:
    scale = absmax / QMAX (1 for an all-zero block), weight = round(W / scale) for int8, W / scale
    rounded to the nearest float8_e4m3fn for fp8. Whole rows of blocks at a time
    (QUANTIZE_CHUNK_BYTES), each independent of the others, so the result is the same."""
    rows, cols = block_size
    out_features, in_features = weight.shape
    grid = scale_shape(out_features, in_features, block_size)
    quantized = torch.empty(
        weight.shape, dtype=torch.int8 if method == "int8" else torch.float8_e4m3fn, device=weight.device
    )
    scale = torch.empty(grid, dtype=torch.float32, device=weight.device)
    block_rows_per_chunk = max(1, QUANTIZE_CHUNK_BYTES // (rows * grid[1] * cols * 4))
    for first in range(0, grid[0], block_rows_per_chunk):
        last = min(grid[0], first + block_rows_per_chunk)
        chunk = weight[first * rows : min(last * rows, out_features)]
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
