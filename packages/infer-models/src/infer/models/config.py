"""Our own frozen view of a Hugging Face `config.json`, for the three supported architectures.

Two generations of keys are read. transformers 5 writes `rope_parameters`, either flat
(`{"rope_type": ..., "rope_theta": ...}`) or per layer type (`{"full_attention": {...},
"sliding_attention": {...}}`, as Gemma 3 does). Older checkpoints write `rope_theta` and
`rope_scaling` (and Gemma 3's `rope_local_base_freq` for its sliding layers).
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from infer.models.quantization import Quantization, parse_quantization_config

# The config.json model_types read here. infer.models.registry gives each its architecture; it
# imports this module, so the list lives here and the import arrow points one way.
MODEL_TYPES = ("gemma3", "gemma3_text", "llama", "qwen3", "qwen3_vl")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# The one table of the dtypes a model runs in, by the name configs and flags use.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # A Hugging Face rope-scaling dict (rope_type "llama3", "linear"), None for plain RoPE.
    scaling: dict | None = None
    # Multimodal RoPE (Qwen3-VL): how many of the head_dim // 2 frequencies follow each axis of a
    # token's (t, h, w) position, interleaved (infer.models.mrope); None: one position per token.
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # RoPE of full-attention layers, and of sliding-window layers where they differ (Gemma 3).
    rope: RopeConfig
    local_rope: RopeConfig | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU).
    hidden_activation: str = "silu"
    # One of FULL_ATTENTION / SLIDING_ATTENTION per layer.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # The dtype the checkpoint was saved in; None when config.json does not say.
    dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # How the checkpoint stores its Linear weights (its `quantization_config`); None: dense.
    quantization: Quantization | None = None

    @property
    def attention_scale(self) -> float:
        # Gemma scales queries by query_pre_attn_scalar**-0.5, the others by head_dim**-0.5.
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for_layer(self, layer_idx: int) -> RopeConfig:
        if self.layer_types[layer_idx] == SLIDING_ATTENTION and self.local_rope is not None:
            return self.local_rope
        return self.rope

    def sliding_window_for_layer(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @staticmethod
    def from_file(path: str | Path) -> "ModelConfig":
        """Reads `config.json` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no config.json at {path}; is this a Hugging Face checkpoint folder?"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        return ModelConfig.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict) -> "ModelConfig":
        """Parses a `config.json` mapping; raises for a model_type not in MODEL_TYPES."""
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            registered = ", ".join(sorted(MODEL_TYPES))
            raise ValueError(f"model_type {model_type!r} is not supported; registered: {registered}")
        dtype = _parse_dtype(raw.get("dtype", raw.get("torch_dtype")))
        if model_type == "gemma3":
            # The multimodal Gemma 3 config nests the language model's config; we run its text part.
            text = dict(raw.get("text_config") or {})
            text.setdefault("model_type", "gemma3_text")
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
            text.setdefault("quantization_config", raw.get("quantization_config"))
            nested = ModelConfig.from_dict(text)
            return replace(nested, model_type="gemma3", dtype=nested.dtype or dtype)
        if model_type == "qwen3_vl":
            # Qwen3-VL nests its language model (Qwen 3 with M-RoPE) as text_config; transformers
            # ties the LM head by the outer config's tie_word_embeddings.
            text = dict(raw.get("text_config") or {})
            text["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
            text.setdefault("quantization_config", raw.get("quantization_config"))
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                text.setdefault(key, raw.get(key))
            text_dtype = _parse_dtype(text.get("dtype", text.get("torch_dtype")))
            nested = _parse_text_config(text, "qwen3_vl", text_dtype)
            return replace(nested, dtype=nested.dtype or dtype)
        return _parse_text_config(raw, model_type, dtype)


def _parse_text_config(raw: dict, model_type: str, dtype: torch.dtype | None) -> ModelConfig:
    is_gemma = model_type.startswith("gemma3")
    hidden_size = _required(raw, "hidden_size")
    num_heads = _required(raw, "num_attention_heads")
    num_layers = _required(raw, "num_hidden_layers")
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    rope, local_rope = _parse_rope(raw, default_theta=1_000_000.0 if is_gemma else 10_000.0)
    layer_types = tuple(raw.get("layer_types") or _default_layer_types(raw, num_layers, is_gemma))
    if len(layer_types) != num_layers or set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(
            f"layer_types must list {FULL_ATTENTION!r}/{SLIDING_ATTENTION!r} once per layer "
            f"({num_layers} layers), got {list(layer_types)}"
        )
    sliding_window = raw.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    if SLIDING_ATTENTION in layer_types and not sliding_window:
        raise ValueError("config has sliding_attention layers but no positive sliding_window")
    eos = raw.get("eos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=_required(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_required(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        rope=rope,
        local_rope=local_rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma)),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_activation=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        layer_types=layer_types,
        sliding_window=sliding_window,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if is_gemma else None,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        dtype=dtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        pad_token_id=raw.get("pad_token_id"),
        quantization=parse_quantization_config(raw.get("quantization_config")),
    )


def _parse_rope(raw: dict, *, default_theta: float) -> tuple[RopeConfig, RopeConfig | None]:
    params = raw.get("rope_parameters")
    if params and FULL_ATTENTION in params:
        local = params.get(SLIDING_ATTENTION)
        return _rope_from(params[FULL_ATTENTION], default_theta), (
            _rope_from(local, default_theta) if local else None
        )
    if params:
        return _rope_from(params, default_theta), None
    # Older keys: rope_theta + rope_scaling; Gemma 3's sliding layers use rope_local_base_freq.
    scaling = dict(raw.get("rope_scaling") or {})
    scaling["rope_theta"] = raw.get("rope_theta", default_theta)
    local_base = raw.get("rope_local_base_freq")
    return _rope_from(scaling, default_theta), (RopeConfig(float(local_base)) if local_base else None)


def _rope_from(params: dict, default_theta: float) -> RopeConfig:
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    # Qwen3-VL's layout is always interleaved (transformers ignores mrope_interleaved).
    mrope_section, _ = params.pop("mrope_section", None), params.pop("mrope_interleaved", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=theta,
        scaling=None if rope_type in ("default", None) else params,
        mrope_section=tuple(mrope_section) if mrope_section else None,
    )


def _default_layer_types(raw: dict, num_layers: int, is_gemma: bool) -> list[str]:
    # Older Gemma 3 configs give a pattern instead of a list: every pattern-th layer is global.
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
    if is_gemma and pattern:
        return [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)]
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        # Qwen: layers from max_window_layers on use the window.
        first_sliding = raw.get("max_window_layers", 0)
        return [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
    return [FULL_ATTENTION] * num_layers


def _parse_dtype(name) -> torch.dtype | None:
    if name is None:
        return None
    if isinstance(name, str) and name in TORCH_DTYPES:
        return TORCH_DTYPES[name]
    raise ValueError(f"config dtype must be one of {sorted(TORCH_DTYPES)}, got {name!r}")


def _required(raw: dict, key: str):
    if key not in raw:
        raise ValueError(f"config.json lacks required key {key!r}")
    return raw[key]
