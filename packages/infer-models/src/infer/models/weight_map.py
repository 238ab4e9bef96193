"""Which checkpoint tensors make each of our parameters.

Our modules keep Hugging Face's names without the decoder prefix ("model."), except two fusions
that turn three (or two) matmuls into one, since decode is bound by reading the weights:
`self_attn.qkv_proj` = cat(q_proj, k_proj, v_proj) and `mlp.gate_up_proj` = cat(gate_proj, up_proj),
concatenated along the output dim (dim 0) in that order.

An 8-bit Linear's `weight_scale` comes from the checkpoint's scale tensors (`weight_scale` or
fp8's `weight_scale_inv`), concatenated the same way; a tied LM head that is quantized at load
comes from the embedding table.
"""

import math
from dataclasses import dataclass

from infer.models.config import ModelConfig
from infer.models.quantization import Quantization

FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Tensors some checkpoints carry that are recomputed rather than loaded.
RECOMPUTED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightSource:
    # Our parameter's name, e.g. "layers.0.self_attn.qkv_proj.weight".
    param_name: str
    # Checkpoint tensors concatenated along dim 0 (one name when not fused).
    checkpoint_names: tuple[str, ...]

    # Rows (dim 0) each checkpoint tensor contributes, in order.
    rows: tuple[int, ...]
    # Scales stored one row per `repeat_rows` weight rows and wanted one per weight row: each
    # stored row is repeated that many times and the part cut to its `part_rows` (1: as stored).
    repeat_rows: int = 1
    part_rows: tuple[int, ...] = ()


def weight_source(
    param_name: str,
    param_rows: int,
    config: ModelConfig,
    prefix: str,
    *,
    quantization: Quantization | None = None,
    scale_block_rows: int = 1,
) -> WeightSource:
    """The checkpoint tensors behind `param_name`; `prefix` is the decoder's ("model."). For a
    `weight_scale`, `quantization` says the checkpoint's format and `scale_block_rows` the weight
    rows per scale row of our parameter."""
    module_path, _, leaf = param_name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    if param_name == "lm_head.weight" and config.tie_word_embeddings:
        return WeightSource(param_name, (f"{prefix}embed_tokens.weight",), (param_rows,))
    full_prefix = "" if param_name.startswith("lm_head.") else prefix
    stored_leaf = leaf
    if leaf == "weight_scale":
        if quantization is None:
            raise ValueError(f"{param_name}: a weight_scale needs the checkpoint's quantization")
        stored_leaf = quantization.scale_name
    if module_name not in FUSED_PROJECTIONS:
        return WeightSource(param_name, (f"{full_prefix}{module_path}.{stored_leaf}",), (param_rows,))
    names = tuple(f"{full_prefix}{parent}.{part}.{stored_leaf}" for part in FUSED_PROJECTIONS[module_name])
    rows = fused_rows(module_name, config)
    if leaf != "weight_scale":
        return WeightSource(param_name, names, rows)
    stored_block_rows = quantization.block_size[0] if quantization.block_size else 1
    stored = tuple(math.ceil(r / stored_block_rows) for r in rows)
    if scale_block_rows == stored_block_rows:
        return WeightSource(param_name, names, stored)
    return WeightSource(param_name, names, stored, repeat_rows=stored_block_rows, part_rows=rows)


def fused_rows(module_name: str, config: ModelConfig) -> tuple[int, ...]:
    """Rows of each checkpoint weight fused into `module_name` ("qkv_proj" or "gate_up_proj")."""
    if module_name == "qkv_proj":
        kv_rows = config.num_kv_heads * config.head_dim
        return (config.num_heads * config.head_dim, kv_rows, kv_rows)
    return (config.intermediate_size, config.intermediate_size)


def is_recomputed(checkpoint_name: str) -> bool:
    return checkpoint_name.endswith(RECOMPUTED_SUFFIXES)
