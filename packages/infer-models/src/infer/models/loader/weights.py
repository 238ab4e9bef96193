"""Loading safetensors checkpoints (one file, or shards with an index) into our modules.

The model is built on the meta device; each parameter is then read from disk, fused where the
weight map says so, cast to the requested dtype and placed on the device one tensor at a time,
so peak memory stays near the model's size. Every problem is reported before any data is read:
missing tensors, unexpected tensors, wrong shapes and 8-bit weights stored in another dtype in one
error, a corrupt header naming the file.

8-bit Linears (infer.models.quantization) take their weights and scales as stored, or, when
quantized at load, their dense weight quantized on the device as it arrives. 4-bit Linears take
a GPTQ or AWQ checkpoint's packed tensors repacked on the device, one Linear at a time
(infer.models.loader.int4_checkpoint), or their dense weight quantized as it arrives
(infer.models.int4_weights.quantize_int4). A tensor-parallel shard's parameters
(infer.models.tensor_parallel) take their rank's part of each tensor, checked against the whole
tensor's shape.
"""

import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from infer.models.config import ModelConfig
from infer.models.int4_weights import Int4FormatError, quantize_int4
from infer.models.loader.int4_checkpoint import (
    INT4_PARAMETERS,
    Int4Source,
    expected_tensors,
    int4_source,
    load_int4_linear,
    optional_tensors,
)
from infer.models.quantization import SAFETENSORS_DTYPES, Quantization, quantize_weight
from infer.models.weight_map import WeightSource, is_recomputed, weight_source

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Largest header we accept: real headers are a few MB; more means a corrupt length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_LISTED_PROBLEMS = 10
# Activation-quantization tensors of int8 checkpoints (compressed-tensors w8a8): we run the
# weights alone (w8a16), so these are not read.
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".input_zero_point")
# A checkpoint's static fp8 KV-cache scales (vLLM's k_scale / v_scale per attention layer): read
# past. The fp8 cache computes a scale per token and head as it writes (infer.kernels.kv_fp8),
# at least as close to each vector as one scale for the whole layer.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
CPU_ALIGNMENT = 64


class CheckpointError(ValueError):
    """The checkpoint does not match the model: its message lists every problem found."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes of one .safetensors file, without reading the data."""
    path = Path(path)
    size = path.stat().st_size

    def corrupt(reason: str) -> ValueError:
        return ValueError(
            f"{path}: corrupt safetensors header ({reason}); delete the file and fetch it again"
        )

    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise corrupt(f"file is {size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise corrupt(f"header length {header_len} exceeds the file's {size - 8} remaining bytes")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise corrupt(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise corrupt(f"header is a JSON {type(header).__name__}, not an object")
    data_bytes = size - 8 - header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
            tensors[name] = TensorInfo(path, entry["dtype"], tuple(int(d) for d in entry["shape"]))
        except (TypeError, KeyError, ValueError):
            raise corrupt(f"entry {name!r} lacks dtype/shape/data_offsets: {entry!r}") from None
        if not 0 <= start <= end <= data_bytes:
            raise corrupt(f"tensor {name!r} spans bytes {start}..{end}, past the {data_bytes} data bytes")
    return tensors


def checkpoint_tensors(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint folder, from `model.safetensors` or the shards its index names."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    # The single file wins when both exist, as in transformers, so both load the same weights.
    if (folder / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    elif index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index_path}: not a safetensors index with a 'weight_map' ({err})") from None
        files = sorted(set(weight_map.values()))
    else:
        raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors: dict[str, TensorInfo] = {}
    for file_name in files:
        shard = folder / file_name
        if not shard.exists():
            raise FileNotFoundError(f"{index_path} names shard {file_name}, which is not in {folder}")
        tensors.update(read_safetensors_header(shard))
    if weight_map is not None:
        unlisted = sorted(set(weight_map) - set(tensors))
        if unlisted:
            raise CheckpointError(f"{index_path} lists tensors no shard holds: {_listing(unlisted)}")
    return tensors


def load_weights(
    model: nn.Module,
    folder: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    prefixes: tuple[str, ...] = ("model.",),
    ignored_prefixes: tuple[str, ...] = (),
    quantization: Quantization | None = None,
) -> None:
    """Fills every parameter of `model` (built on any device, meta included) from `folder`: dense
    ones cast to `dtype`, 8-bit ones (made by `quantize_linears` for `quantization`) as stored or
    quantized as they load."""
    tensors = checkpoint_tensors(folder)
    prefix = next((p for p in prefixes if f"{p}embed_tokens.weight" in tensors), prefixes[0])
    params = dict(model.named_parameters())
    sources, quantized_at_load, shards, full_rest = {}, set(), {}, {}
    int4_sources: dict[str, Int4Source] = {}
    for name, param in params.items():
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        if getattr(module, "group_size", None) is not None and leaf in INT4_PARAMETERS:
            if quantization.in_checkpoint:
                int4_sources.setdefault(module_path, int4_source(module_path, module, config, prefix))
                continue
            if leaf != "weight":
                continue  # made from the weight as it loads
            quantized_at_load.add(name)
            shards[name], full_rest[name] = None, (module.in_features,)
            sources[name] = weight_source(name, module.out_features, config, prefix)
            continue
        block_size = getattr(module, "block_size", None)
        shards[name] = getattr(module, "tp_shard", None)
        if leaf == "weight_scale" and shards[name] is not None and shards[name].dim == 1:
            shards[name] = None  # a row-parallel shard holds every row's scale (tensor_parallel.py)
        # The checkpoint's shape: a shard's parameter holds part of it.
        param_rows, full_rest[name] = param.shape[0], tuple(param.shape[1:])
        if shards[name] is not None and shards[name].dim == 0 and len(shards[name].full_sizes) == 1:
            param_rows = shards[name].full_sizes[0]
        elif shards[name] is not None and shards[name].dim == 1:
            full_rest[name] = shards[name].full_sizes
        if block_size is not None and not quantization.in_checkpoint:
            if leaf == "weight_scale":
                continue  # made from the weight as it loads
            quantized_at_load.add(name)
        sources[name] = weight_source(
            name,
            param_rows,
            config,
            prefix,
            quantization=quantization,
            scale_block_rows=block_size[0] if block_size else 1,
        )
    _check_against(
        sources,
        params,
        full_rest,
        tensors,
        config,
        ignored_prefixes,
        folder,
        quantization,
        quantized_at_load,
        int4_sources,
    )

    aliases = _parameter_aliases(model)
    with ExitStack() as stack:
        handles = {}

        def read(tensor_name: str) -> torch.Tensor:
            file = tensors[tensor_name].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            return handles[file].get_tensor(tensor_name)

        for name, source in sources.items():
            target_dtype = dtype if name in quantized_at_load else params[name].dtype
            parts = [read(tensor_name).to(target_dtype) for tensor_name in source.checkpoint_names]
            if (shard := shards[name]) is not None:
                # Contiguous: a row-parallel shard's columns are a strided view, and 8-bit
                # kernels take contiguous weights only.
                parts = [shard.take(index, part).contiguous() for index, part in enumerate(parts)]
                if shard.padding:
                    parts.append(parts[0].new_zeros(shard.padding, *parts[0].shape[1:]))
            if source.repeat_rows > 1:
                parts = [
                    part.repeat_interleave(source.repeat_rows, dim=0)[:rows]
                    for part, rows in zip(parts, source.part_rows, strict=True)
                ]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            # A weight quantized at load stays dense on the host; on the device only a chunk at
            # a time, as it is quantized.
            if name in quantized_at_load and quantization.is_int4:
                module = model.get_submodule(name.rpartition(".")[0])
                packed = quantize_int4(value, module.group_size, module.weight_scale.dtype, device=device)
                module.weight_scale = nn.Parameter(packed.scales, requires_grad=False)
                module.weight_zero = nn.Parameter(packed.zeros, requires_grad=False)
                value = packed.qweight
            elif name in quantized_at_load:
                module = model.get_submodule(name.rpartition(".")[0])
                weight, scale = quantize_weight(value, quantization.method, module.block_size, device)
                module.weight_scale = nn.Parameter(scale, requires_grad=False)
                value = weight
            else:
                value = value.to(device)
            if value.device.type == "cpu" and value.data_ptr() % CPU_ALIGNMENT:
                # A tensor read as stored starts wherever the file put it; vectorized CPU
                # kernels (ATen's int8 one among them) want their operands aligned.
                value = value.clone()
            loaded = nn.Parameter(value, requires_grad=False)
            for module_name, leaf in aliases[name]:
                setattr(model.get_submodule(module_name), leaf, loaded)
        for module_name, source in int4_sources.items():
            try:
                load_int4_linear(
                    model.get_submodule(module_name), source, quantization, read, tensors, device
                )
            except Int4FormatError as error:
                raise CheckpointError(f"checkpoint {folder}: {error}") from None


def fill_random_weights(model: nn.Module, arch: str, *, dtype: torch.dtype, device, seed: int = 0) -> None:
    """Fills every parameter of `model` (built on the meta device) with random weights made on
    `device` (`load_format="dummy"`, nothing read from disk), by the rules of a random checkpoint
    (infer.models.random_checkpoint.random_tensor): logits of a trained model's spread, whatever
    the shapes. A tensor-parallel shard makes its own part."""
    from infer.models.random_checkpoint import random_tensor

    generator = torch.Generator(device).manual_seed(seed)
    aliases = _parameter_aliases(model)
    for name, param in dict(model.named_parameters()).items():
        value = random_tensor(name, tuple(param.shape), arch, generator).to(dtype)
        loaded = nn.Parameter(value, requires_grad=False)
        for module_name, leaf in aliases[name]:
            setattr(model.get_submodule(module_name), leaf, loaded)


def _check_against(
    sources: dict[str, WeightSource],
    params: dict[str, nn.Parameter],
    full_rest: dict[str, tuple[int, ...]],
    tensors: dict[str, TensorInfo],
    config: ModelConfig,
    ignored_prefixes: tuple[str, ...],
    folder: Path,
    quantization: Quantization | None,
    quantized_at_load: set[str],
    int4_sources: dict[str, Int4Source],
) -> None:
    missing, wrong_shapes, wrong_dtypes, used = [], [], [], set()
    for source in int4_sources.values():
        used.update(optional_tensors(source))
        for tensor_name, (shape, dtypes) in expected_tensors(source, quantization).items():
            used.add(tensor_name)
            if tensor_name not in tensors:
                missing.append(tensor_name)
                continue
            if (found := tensors[tensor_name].shape) != shape:
                wrong_shapes.append(f"{tensor_name}: expected {list(shape)}, got {list(found)}")
            if (found_dtype := tensors[tensor_name].dtype) not in dtypes:
                wrong_dtypes.append(f"{tensor_name}: expected {' or '.join(dtypes)}, got {found_dtype}")
    for name, source in sources.items():
        expected_rest = full_rest[name]
        stored_8bit = params[name].dtype.itemsize == 1 and name not in quantized_at_load
        for tensor_name, rows in zip(source.checkpoint_names, source.rows, strict=True):
            used.add(tensor_name)
            if tensor_name not in tensors:
                missing.append(tensor_name)
                continue
            if (found := tensors[tensor_name].shape) != (rows, *expected_rest):
                wrong_shapes.append(f"{tensor_name}: expected {[rows, *expected_rest]}, got {list(found)}")
            if stored_8bit and (found_dtype := tensors[tensor_name].dtype) != (
                wanted := SAFETENSORS_DTYPES[quantization.method]
            ):
                wrong_dtypes.append(f"{tensor_name}: expected {wanted}, got {found_dtype}")
    if config.tie_word_embeddings:
        # Tied checkpoints sometimes still store the head; it must equal the embedding, so skip it.
        used.add("lm_head.weight")
    skipped = ACTIVATION_SCALE_SUFFIXES if quantization is not None and quantization.in_checkpoint else ()
    unexpected = [
        t
        for t in tensors
        if t not in used
        and not is_recomputed(t)
        and not t.startswith(ignored_prefixes)
        and not (skipped and t.endswith(skipped))
        and not t.endswith(KV_SCALE_SUFFIXES)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(sorted(unexpected))}")
    if wrong_shapes:
        problems.append(f"wrong shapes: {_listing(wrong_shapes)}")
    if wrong_dtypes:
        problems.append(f"wrong dtypes: {_listing(wrong_dtypes)}")
    if problems:
        described = config.model_type + (f" ({quantization.method})" if quantization else "")
        raise CheckpointError(
            f"checkpoint {folder} does not match a {described} model with this config.json: "
            + "; ".join(problems)
        )


def _parameter_aliases(model: nn.Module) -> dict[str, list[tuple[str, str]]]:
    """For each deduplicated parameter name, every (module, attribute) holding it (tied weights)."""
    first_name = {id(p): name for name, p in model.named_parameters()}
    aliases: dict[str, list[tuple[str, str]]] = {name: [] for name in first_name.values()}
    for name, p in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        aliases[first_name[id(p)]].append((module_name, leaf))
    return aliases


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_LISTED_PROBLEMS])
    more = len(items) - _LISTED_PROBLEMS
    return shown + (f" and {more} more" if more > 0 else "")
