"""ModelConfig parsing, checked against transformers' own config classes as the oracle."""

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

from infer.models.config import FULL_ATTENTION, MODEL_TYPES, SLIDING_ATTENTION, ModelConfig, RopeConfig
from infer.models.random_checkpoint import PRESETS

HF_CONFIG_CLASSES = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig}


def _hf_config(preset_name: str):
    preset = PRESETS[preset_name]
    return HF_CONFIG_CLASSES[preset.arch](**preset.config)


@pytest.mark.parametrize(
    "preset_name", ["llama-3.2-1b", "qwen3-8b", "gemma-3-1b", "gemma3-tiny", "qwen3-tiny"]
)
def test_transformers_5_config_parses_to_the_same_shapes(preset_name):
    hf = _hf_config(preset_name)
    config = ModelConfig.from_dict(hf.to_dict())
    assert (config.hidden_size, config.num_layers, config.vocab_size) == (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.vocab_size,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    )
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert list(config.layer_types) == list(
        getattr(hf, "layer_types", None) or [FULL_ATTENTION] * hf.num_hidden_layers
    )


def test_gemma_rope_parameters_per_layer_type():
    hf = _hf_config("gemma-3-1b")
    config = ModelConfig.from_dict(hf.to_dict())
    assert config.rope == RopeConfig(hf.rope_parameters["full_attention"]["rope_theta"])
    assert config.local_rope == RopeConfig(hf.rope_parameters["sliding_attention"]["rope_theta"])
    sliding_layer = list(hf.layer_types).index(SLIDING_ATTENTION)
    full_layer = list(hf.layer_types).index(FULL_ATTENTION)
    assert config.rope_for_layer(sliding_layer).theta == 10_000.0
    assert config.rope_for_layer(full_layer).theta == 1_000_000.0
    assert config.sliding_window_for_layer(sliding_layer) == hf.sliding_window
    assert config.sliding_window_for_layer(full_layer) is None
    assert config.attention_scale == hf.query_pre_attn_scalar**-0.5


def test_older_llama_keys_rope_theta_and_rope_scaling():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    raw = _minimal("llama", rope_theta=500000.0, rope_scaling=scaling, torch_dtype="bfloat16")
    config = ModelConfig.from_dict(raw)
    assert config.rope == RopeConfig(500000.0, scaling)
    assert config.dtype == torch.bfloat16
    # transformers reads the same old keys to the same rope parameters.
    hf = LlamaConfig(**raw)
    assert hf.rope_parameters["rope_theta"] == config.rope.theta
    assert hf.rope_parameters["factor"] == config.rope.scaling["factor"]


def test_older_gemma_keys_local_base_and_pattern():
    raw = _minimal("gemma3_text", num_hidden_layers=12, rope_theta=1e6, rope_local_base_freq=1e4,
                   sliding_window=512, sliding_window_pattern=6)  # fmt: skip
    config = ModelConfig.from_dict(raw)
    assert config.rope.theta == 1e6 and config.local_rope.theta == 1e4
    assert list(config.layer_types) == list(Gemma3TextConfig(**raw).layer_types)
    assert config.tie_word_embeddings  # Gemma ties by default, as transformers does


def test_head_dim_defaults_to_hidden_over_heads():
    config = ModelConfig.from_dict(_minimal("llama", hidden_size=96, num_attention_heads=6))
    assert (
        config.head_dim
        == 16
        == LlamaConfig(**_minimal("llama", hidden_size=96, num_attention_heads=6)).head_dim
    )
    assert config.num_kv_heads == 6
    assert config.attention_scale == 16**-0.5


def test_multimodal_gemma3_reads_its_text_config():
    text = _hf_config("gemma3-tiny").to_dict()
    config = ModelConfig.from_dict({"model_type": "gemma3", "text_config": text})
    assert config.model_type == "gemma3"
    assert config.hidden_size == text["hidden_size"]
    assert config.final_logit_softcapping == text["final_logit_softcapping"]


def test_unknown_model_type_lists_the_registered_ones():
    with pytest.raises(
        ValueError, match=r"'mistral' is not supported; registered: gemma3, gemma3_text, llama, qwen3"
    ):
        ModelConfig.from_dict(_minimal("mistral"))


def test_every_model_type_the_config_reads_has_an_architecture():
    from infer.models.registry import registered_model_types

    assert registered_model_types() == sorted(MODEL_TYPES)


def test_missing_key_is_named():
    raw = _minimal("llama")
    del raw["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict(raw)


def test_from_file_reads_a_checkpoint_folder(tmp_path):
    hf = _hf_config("qwen3-tiny")
    hf.save_pretrained(tmp_path)
    assert ModelConfig.from_file(tmp_path) == ModelConfig.from_dict(hf.to_dict())


def _minimal(model_type: str, **overrides) -> dict:
    raw = dict(model_type=model_type, vocab_size=100, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    return {**raw, **overrides}
