"""Which checkpoint tensors make each of our parameters.

Our modules keep Hugging Face's names without the decoder prefix ("model."), except two fusions
that turn three (or two) matmuls into one, since decode is bound by reading the weights:
`self_attn.qkv_proj` = cat(q_proj, k_proj, v_proj) and `mlp.gate_up_proj` = cat(gate_proj, up_proj),
concatenated along the output dim (dim 0) in that order.
"""

from dataclasses import dataclass

from infer.models.config import ModelConfig

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


def weight_source(param_name: str, param_rows: int, config: ModelConfig, prefix: str) -> WeightSource:
    """The checkpoint tensors behind `param_name`; `prefix` is the decoder's ("model.")."""
    module_path, _, leaf = param_name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    full_prefix = "" if param_name.startswith("lm_head.") else prefix
    if module_name not in FUSED_PROJECTIONS:
        return WeightSource(param_name, (f"{full_prefix}{param_name}",), (param_rows,))
    names = tuple(f"{full_prefix}{parent}.{part}.{leaf}" for part in FUSED_PROJECTIONS[module_name])
    if module_name == "qkv_proj":
        kv_rows = config.num_kv_heads * config.head_dim
        rows = (config.num_heads * config.head_dim, kv_rows, kv_rows)
    else:
        rows = (config.intermediate_size, config.intermediate_size)
    return WeightSource(param_name, names, rows)


def is_recomputed(checkpoint_name: str) -> bool:
    return checkpoint_name.endswith(RECOMPUTED_SUFFIXES)
