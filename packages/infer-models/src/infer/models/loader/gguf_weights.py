"""A model's weights read from a GGUF file as it is stored: Q4_0, Q4_1 and Q8_0 tensors stay in
their blocks (infer.kernels' GGUF_FORMATS), run by `gguf_linear_cpu`; F32, F16 and BF16 tensors,
and blocks of other formats (dequantized by gguf.quants at load), are dense. Q8_0 blocks are
repacked at load into infer.kernels' "q8_0x4" layout (GGUF_REPACKED: the same bytes, four rows
interleaved), which the one-row product reads faster
(docs/benchmarks/quantization.md#cpu-the-default-models-gguf-file-as-shipped-issue-55).

The alias's folder (fetch_model) still gives the config and the tokenizer; the weights come from
the GGUF file it was converted from (`gguf_file_for`). We undo the layout change llama.cpp's
converter makes, as transformers does when it dequantizes (transformers'
modeling_gguf_pytorch_utils.LlamaTensorProcessor): Llama's q and k rows are permuted within each
head; a packed row is whole blocks of one output row, so rows of blocks move and blocks stay whole.
Llama only for now: other families (Gemma's norms stored as 1 + w, Qwen 3's QK norms) raise.

On the meta-device model, `pack_for_gguf` turns every Linear whose GGUF tensors share one block
format (and the embedding, which the tied LM head shares) into a packed one, in the layout it will
hold; `load_gguf_weights` then fills every parameter, repacking where that layout asks.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from infer.kernels import GGUF_FORMATS, GGUF_REPACKED, dequantize_gguf, gguf_file_format, repack_gguf
from infer.models.config import ModelConfig
from infer.models.linear import Linear
from infer.models.weight_map import FUSED_PROJECTIONS

if TYPE_CHECKING:
    import gguf

# GGUF tensor names (after "blk.N.") and ours (after "layers.N."), Llama's.
LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
DENSE_TYPES = ("F32", "F16", "BF16")
MANIFEST_FILE = "infer_manifest.json"


@dataclass(frozen=True)
class GgufTensor:
    """One tensor as stored: `fmt` a block format of GGUF_FORMATS with `data` uint8
    [rows, row bytes], or None with `data` dense [rows, ...] (float32 unless stored F16/BF16)."""

    fmt: str | None
    data: torch.Tensor

    def dense(self) -> torch.Tensor:
        return self.data if self.fmt is None else dequantize_gguf(self.data, self.fmt)


def gguf_file_for(folder: Path) -> Path:
    """The GGUF file an alias's folder was converted from (its manifest names the alias)."""
    from infer.models.loader.fetch import KNOWN_MODELS, infer_home, locate_gguf

    manifest_path = Path(folder) / MANIFEST_FILE
    alias = (
        json.loads(manifest_path.read_text()).get("source", {}).get("alias")
        if manifest_path.is_file()
        else None
    )
    if alias not in KNOWN_MODELS:
        raise ValueError(
            f"{folder} was not converted from a known alias's GGUF file (quantization 'gguf' runs the "
            f"GGUF file of one of {sorted(KNOWN_MODELS)})"
        )
    scratch = infer_home() / "gguf" / alias
    scratch.mkdir(parents=True, exist_ok=True)
    return locate_gguf(KNOWN_MODELS[alias], scratch)[0]


def load_gguf_causal_lm(
    folder: Path, config: ModelConfig, model_class, *, packed: bool = True, gguf_path: Path | None = None
) -> nn.Module:
    """`model_class(config)` with the weights of the folder's GGUF file (or `gguf_path`, a file of
    the same model), float32 activations (the GGUF kernels take and return them): block tensors
    packed, or with `packed=False` every tensor dequantized to float32 (the oracle the packed
    model is tested against)."""
    tensors = read_gguf_tensors(gguf_path or gguf_file_for(folder), config)
    with torch.device("meta"):
        model = model_class(config).to(torch.float32)
        if packed:
            pack_for_gguf(model, tensors, config)
    model.quantization = None
    load_gguf_weights(model, tensors, config, dtype=torch.float32)
    return model


def read_gguf_tensors(path: Path, config: ModelConfig) -> dict[str, GgufTensor]:
    """Every tensor of the GGUF file by our unfused name ("layers.0.self_attn.q_proj.weight"),
    llama.cpp's q/k permutation undone."""
    import gguf

    if config.model_type != "llama":
        raise ValueError(f"quantization 'gguf' reads Llama models only, not {config.model_type}")
    tensors = {}
    for tensor in gguf_file_tensors(path):
        name = our_tensor_name(tensor.name)
        kind = tensor.tensor_type.name
        if kind.lower() in GGUF_FORMATS:
            fmt, data = kind.lower(), torch.from_numpy(np.array(tensor.data))
        elif kind in DENSE_TYPES:
            fmt, data = None, torch.from_numpy(np.array(tensor.data))
            data = data.view(torch.bfloat16) if kind == "BF16" else data
        else:
            fmt, data = None, torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            data = _unpermute_rows(data, heads)
        tensors[name] = GgufTensor(fmt, data)
    return tensors


@dataclass(frozen=True)
class GgufFileTensor:
    """A tensor of a GGUF file as gguf.GGUFReader gives it: `data` a read-only view of the file,
    the element type's [*dims reversed] for the scalar types, uint8 [..., row bytes] otherwise."""

    name: str
    tensor_type: "gguf.GGMLQuantizationType"
    data: np.ndarray


# GGUF metadata value types (gguf.GGUFValueType) that are fixed-size scalars: their byte sizes.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


def gguf_file_tensors(path: Path) -> list[GgufFileTensor]:
    """The tensors of a little-endian GGUF file (version 2 or 3), their data as gguf.GGUFReader's
    `tensors` hold it. The metadata is stepped over with struct, only general.alignment kept:
    GGUFReader builds a numpy view of every metadata element, and the default model's 98,000
    vocabulary strings and merges took 11 s of its 12 s load, at every `infer serve` start."""
    import struct

    import gguf

    data = np.memmap(path, mode="r")
    magic, version, num_tensors, num_fields = struct.unpack_from("<IIQQ", data, 0)
    if magic != gguf.GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
    offset, alignment = 24, gguf.GGUF_DEFAULT_ALIGNMENT

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return bytes(data[at + 8 : at + 8 + length]).decode(), at + 8 + length

    def skip_value(kind: int, at: int) -> int:
        if kind in _GGUF_SCALAR_BYTES:
            return at + _GGUF_SCALAR_BYTES[kind]
        if kind == _GGUF_STRING:
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        if kind != _GGUF_ARRAY:
            raise ValueError(f"{path}: GGUF metadata value type {kind} is not one of GGUF's")
        element, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if element in _GGUF_SCALAR_BYTES:
            return at + count * _GGUF_SCALAR_BYTES[element]
        for _ in range(count):
            at = skip_value(element, at)
        return at

    for _ in range(num_fields):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        if key == "general.alignment" and kind == _GGUF_UINT32:
            (alignment,) = struct.unpack_from("<I", data, offset + 4)
        offset = skip_value(kind, offset + 4)
    infos = []
    for _ in range(num_tensors):
        name, offset = string(offset)
        (num_dims,) = struct.unpack_from("<I", data, offset)
        dims = struct.unpack_from(f"<{num_dims}Q", data, offset + 4)
        kind, tensor_offset = struct.unpack_from("<IQ", data, offset + 4 + 8 * num_dims)
        offset += 4 + 8 * num_dims + 12
        infos.append((name, dims, gguf.GGMLQuantizationType(kind), tensor_offset))
    start = offset + (-offset) % alignment
    scalar_types = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                    "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip
    tensors = []
    for name, dims, kind, tensor_offset in infos:
        shape = tuple(reversed(dims))
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        num_bytes = int(np.prod(dims)) * type_size // block_size
        item = scalar_types.get(kind.name, np.uint8)
        if item is np.uint8:
            shape = gguf.quant_shape_to_byte_shape(shape, kind)
        at = start + tensor_offset
        tensors.append(GgufFileTensor(name, kind, data[at : at + num_bytes].view(item).reshape(shape)))
    return tensors


def our_tensor_name(gguf_name: str) -> str:
    """Our (and transformers', without its `model.`) name of a Llama GGUF file's tensor:
    blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight. ValueError for another tensor."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if part not in LLAMA_BLOCK_NAMES:
            raise ValueError(f"GGUF tensor {gguf_name} is not one of a Llama block's")
        return f"layers.{index}.{LLAMA_BLOCK_NAMES[part]}.{leaf}"
    if stem not in LLAMA_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name} is not one of a Llama model's")
    return f"{LLAMA_NAMES[stem]}.{leaf}"


def _unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse permutation: within each head, rows (i, half) -> (half, i)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape).contiguous()


def _parts(name: str) -> list[str]:
    """The unfused tensors behind our Linear `name` ("layers.0.self_attn.qkv_proj")."""
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED_PROJECTIONS[leaf]] if leaf in FUSED_PROJECTIONS else [name]


def pack_for_gguf(model: nn.Module, tensors: dict[str, GgufTensor], config: ModelConfig) -> None:
    """Makes packed, on `model` (meta device), every Linear whose tensors share one block format,
    and the embedding where its table is stored in blocks (the tied LM head with it)."""
    embedding = tensors["embed_tokens.weight"].fmt
    embedding = GGUF_REPACKED.get(embedding, embedding)
    if embedding is not None:
        model.embed_tokens.pack_gguf(embedding)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if name == "lm_head" and config.tie_word_embeddings:
            if embedding is not None:
                module.pack_gguf(embedding)
            continue
        formats = {tensors[f"{part}.weight"].fmt for part in _parts(name)}
        if len(formats) == 1 and None not in formats:
            fmt = formats.pop()
            module.pack_gguf(GGUF_REPACKED.get(fmt, fmt))


def load_gguf_weights(
    model: nn.Module, tensors: dict[str, GgufTensor], config: ModelConfig, *, dtype: torch.dtype
) -> None:
    """Fills every parameter of `model` (after `pack_for_gguf`) from `tensors`: packed ones as
    stored, dense ones cast to `dtype`."""
    used = set()
    for name, param in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        if module_name == "lm_head" and config.tie_word_embeddings:
            continue
        parts = [f"{part}.{leaf}" for part in _parts(module_name)]
        missing = [part for part in parts if part not in tensors]
        if missing:
            raise ValueError(f"the GGUF file has no {', '.join(missing)} for {name}")
        used.update(parts)
        packed = param.dtype == torch.uint8
        values = [tensors[part].data if packed else tensors[part].dense().to(dtype) for part in parts]
        value = values[0] if len(values) == 1 else torch.cat(values, dim=0)
        layout = getattr(model.get_submodule(module_name), "gguf_format", None)
        if packed and layout in GGUF_REPACKED.values():
            value = repack_gguf(value, gguf_file_format(layout))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: the GGUF file gives {list(value.shape)}, the model wants {list(param.shape)}"
            )
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(value.contiguous(), requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    unused = sorted(set(tensors) - used - {"lm_head.weight"})
    if unused:
        raise ValueError(f"the GGUF file has tensors the model does not read: {', '.join(unused[:5])}")
