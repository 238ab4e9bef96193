"""Loading safetensors checkpoints (one file, or shards with an index) into our modules.

The model is built on the meta device; each parameter is then read from disk, fused where the
weight map says so, cast to the requested dtype and placed on the device one tensor at a time,
so peak memory stays near the model's size. Every problem is reported before any data is read:
missing tensors, unexpected tensors and wrong shapes in one error, a corrupt header naming the file.
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
from infer.models.weight_map import WeightSource, is_recomputed, weight_source

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Largest header we accept: real headers are a few MB; more means a corrupt length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_LISTED_PROBLEMS = 10


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
) -> None:
    """Fills every parameter of `model` (built on any device, meta included) from `folder`."""
    tensors = checkpoint_tensors(folder)
    prefix = next((p for p in prefixes if f"{p}embed_tokens.weight" in tensors), prefixes[0])
    params = dict(model.named_parameters())
    sources = {name: weight_source(name, p.shape[0], config, prefix) for name, p in params.items()}
    _check_against(sources, params, tensors, config, ignored_prefixes, folder)

    aliases = _parameter_aliases(model)
    with ExitStack() as stack:
        handles = {}
        for name, source in sources.items():
            parts = []
            for tensor_name in source.checkpoint_names:
                file = tensors[tensor_name].file
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                parts.append(handles[file].get_tensor(tensor_name).to(dtype))
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            loaded = nn.Parameter(value.to(device), requires_grad=False)
            for module_name, leaf in aliases[name]:
                setattr(model.get_submodule(module_name), leaf, loaded)


def _check_against(
    sources: dict[str, WeightSource],
    params: dict[str, nn.Parameter],
    tensors: dict[str, TensorInfo],
    config: ModelConfig,
    ignored_prefixes: tuple[str, ...],
    folder: Path,
) -> None:
    missing, wrong_shapes, used = [], [], set()
    for name, source in sources.items():
        expected_rest = tuple(params[name].shape[1:])
        for tensor_name, rows in zip(source.checkpoint_names, source.rows, strict=True):
            used.add(tensor_name)
            if tensor_name not in tensors:
                missing.append(tensor_name)
            elif (found := tensors[tensor_name].shape) != (rows, *expected_rest):
                wrong_shapes.append(f"{tensor_name}: expected {[rows, *expected_rest]}, got {list(found)}")
    if config.tie_word_embeddings:
        # Tied checkpoints sometimes still store the head; it must equal the embedding, so skip it.
        used.add("lm_head.weight")
    unexpected = [
        t for t in tensors if t not in used and not is_recomputed(t) and not t.startswith(ignored_prefixes)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(sorted(unexpected))}")
    if wrong_shapes:
        problems.append(f"wrong shapes: {_listing(wrong_shapes)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} does not match a {config.model_type} model with this config.json: "
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
