"""Random checkpoints: transformers loads them as its own, the tokenizer fits the model, and the
real-shape presets have the published parameter counts."""

import argparse
import json
import math
import random

import numpy as np
import pytest
import safetensors.torch
import tokenizers
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from infer.models.config import ModelConfig
from infer.models.load import load_model
from infer.models.random_checkpoint import (
    COMMON_WORDS,
    PRESETS,
    _hf_config,
    _special_tokens,
    _tensor_shapes,
    _write_tokenizer,
    make_random_checkpoint,
    register_cli,
)
from infer.models.registry import image_processor_for

# Parameter counts of the released checkpoints (their model cards / safetensors metadata).
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 4_300_079_472,  # the language model, SigLIP and the projector
    # The Hub's safetensors totals of Qwen3-VL-4B-Instruct and -8B-Instruct (the language model,
    # the tower and its mergers).
    "qwen3-vl-4b": 4_437_815_808,
    "qwen3-vl-8b": 8_767_123_696,
}
# The families' real special-token ids, which chat templates and stop tokens rely on.
REAL_SPECIAL_IDS = {
    "llama-3.2-1b": {"<|begin_of_text|>": 128000, "<|eot_id|>": 128009},
    "qwen3-8b": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    "gemma-3-1b": {"<bos>": 2, "<eos>": 1, "<start_of_turn>": 105, "<end_of_turn>": 106},
    "gemma-3-4b": {
        "<bos>": 2, "<start_of_turn>": 105, "<start_of_image>": 255999, "<end_of_image>": 256000,
        "<image_soft_token>": 262144,
    },
    "qwen3-vl-4b": {
        "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
        "<|image_pad|>": 151655, "<|video_pad|>": 151656,
    },
}  # fmt: skip
# google/gemma-3-4b-it's config.json as published (what it leaves out is Gemma3Config's default).
GEMMA_3_4B_IT_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

# Qwen/Qwen3-VL-4B-Instruct's config.json as published ("qwen3_vl" is the releases' old
# model_type of the vision config), and -8B-Instruct's, which differs in these fields.
QWEN3_VL_4B_INSTRUCT_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
QWEN3_VL_8B_INSTRUCT_CONFIG = {
    **QWEN3_VL_4B_INSTRUCT_CONFIG,
    "text_config": {
        **QWEN3_VL_4B_INSTRUCT_CONFIG["text_config"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "tie_word_embeddings": False,
    "vision_config": {
        **QWEN3_VL_4B_INSTRUCT_CONFIG["vision_config"],
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "out_hidden_size": 4096,
    },
}
# Qwen/Qwen3-VL-4B-Instruct's preprocessor_config.json as published, the image processor's fields
# (its processor_class and the torchvision processor's name aside).
QWEN3_VL_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Fields a preset sets by its tokenizer and dtype, or transformers by its version.
_NOT_SHAPE = {
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "architectures",
    "transformers_version",
}


def _preset_hf_config(preset: str):
    spec = PRESETS[preset]
    specials = _special_tokens(spec.arch, spec.config["vocab_size"], images=spec.vision is not None)
    return _hf_config(spec, specials, torch.bfloat16)


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_real_shape_presets_have_the_published_parameter_count(preset):
    shapes = _tensor_shapes(_preset_hf_config(preset))
    assert sum(math.prod(shape) for shape in shapes.values()) == PUBLISHED_PARAMETERS[preset]


@pytest.mark.parametrize("preset", sorted(REAL_SPECIAL_IDS))
def test_special_tokens_sit_at_the_real_ids(preset):
    spec = PRESETS[preset]
    specials = _special_tokens(spec.arch, spec.config["vocab_size"], images=spec.vision is not None)
    assert {token: specials.ids[token] for token in REAL_SPECIAL_IDS[preset]} == REAL_SPECIAL_IDS[preset]


def test_gemma_3_4b_is_the_published_config_as_transformers_reads_it():
    # Token ids and dtype aside, every field transformers makes of the release's config.json
    # (its defaults filled in, its rope_scaling turned into per-layer-type rope_parameters).
    assert_same_config(_preset_hf_config("gemma-3-4b"), Gemma3Config.from_dict(GEMMA_3_4B_IT_CONFIG))


@pytest.mark.parametrize(
    ("preset", "published"),
    [("qwen3-vl-4b", QWEN3_VL_4B_INSTRUCT_CONFIG), ("qwen3-vl-8b", QWEN3_VL_8B_INSTRUCT_CONFIG)],
)
def test_qwen3_vl_is_the_published_config_as_transformers_reads_it(preset, published):
    # transformers turns the release's rope_scaling and rope_theta into rope_parameters, and its
    # vision model_type into qwen3_vl_vision.
    assert_same_config(_preset_hf_config(preset), Qwen3VLConfig.from_dict(published))


def assert_same_config(ours, published) -> None:
    """Token ids and dtype aside, every field of the language model's, the tower's and the outer
    config."""

    def fields(config) -> dict:
        return {key: value for key, value in config.to_dict().items() if key not in _NOT_SHAPE}

    assert fields(ours.text_config) == fields(published.text_config)
    assert fields(ours.vision_config) == fields(published.vision_config)
    assert {key: value for key, value in fields(ours).items() if not key.endswith("_config")} == {
        key: value for key, value in fields(published).items() if not key.endswith("_config")
    }


def test_qwen3_vl_4b_preprocessor_config_is_the_releases(tmp_path):
    folder = make_random_checkpoint("qwen3-vl-4b", tmp_path, weights=False)
    written = json.loads((folder / "preprocessor_config.json").read_text())
    assert {key: written[key] for key in QWEN3_VL_PREPROCESSOR_CONFIG} == QWEN3_VL_PREPROCESSOR_CONFIG


def test_qwen3_thinking_tags_are_text_that_decoding_keeps_as_qwens_tokenizer_has_them(tmp_path):
    # Qwen 3's tokenizer adds <think> and </think> with "special": false, so a server decoding
    # with skip_special_tokens still reads them; <|im_end|> is special and is skipped.
    tokenizer = AutoTokenizer.from_pretrained(make_random_checkpoint("qwen3-tiny", tmp_path))
    ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"])
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think></think>"


@pytest.mark.parametrize(
    "preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "gemma3-vision-tiny", "qwen3-vl-tiny"]
)
def test_tiny_checkpoint_is_a_complete_transformers_checkpoint(preset, tmp_path):
    folder = make_random_checkpoint(preset, tmp_path, dtype=torch.float32)
    # Qwen3-VL's model has no causal-LM mapping, only the image-text-to-text one.
    auto_class = AutoModelForImageTextToText if PRESETS[preset].vision else AutoModelForCausalLM
    model, info = auto_class.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = ModelConfig.from_file(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == config.vocab_size == model.config.get_text_config().vocab_size
    text = "Paris, ça va? 東京 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # Every id the model can emit decodes; the fillers (every id above the specials and the 256
    # byte tokens) to valid text alone, as a real vocabulary's tokens do, so a random model's
    # output streams token by token instead of waiting for characters that never complete.
    tokenizer.decode(list(range(config.vocab_size)))
    tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
    specials = set(tokenizer.added_tokens_decoder)
    fillers = [i for i, token in enumerate(tokens) if len(token) > 1 and i not in specials]
    assert len(fillers) == config.vocab_size - 256 - len(specials)
    assert all(tokenizer.decode([i]).isascii() and tokenizer.decode([i]).isalnum() for i in fillers)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["bos_token_id"] == config.bos_token_id
    if config.bos_token_id is not None:
        assert tokenizer.encode("hi")[0] == config.bos_token_id  # BOS added, as the real tokenizers do


def test_bf16_preset_stores_bf16(tmp_path):
    folder = make_random_checkpoint("gemma3-tiny", tmp_path)
    assert ModelConfig.from_file(folder).dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = make_random_checkpoint("llama-tiny", tmp_path / "a", seed=1)
    b = make_random_checkpoint("llama-tiny", tmp_path / "b", seed=1)
    c = make_random_checkpoint("llama-tiny", tmp_path / "c", seed=2)
    data = {p.name: (p / "model.safetensors").read_bytes() for p in (a, b, c)}
    assert data["a"] == data["b"] != data["c"]


def test_cli_writes_a_sharded_tiny_checkpoint(tmp_path):
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(
        ["random", "gemma3", "--preset", "tiny", "--out", str(tmp_path), "--shards", "2"]
    )
    assert args.func(args) == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert ModelConfig.from_file(tmp_path).model_type == "gemma3_text"


def test_cli_names_a_qwen3_vl_preset_by_its_size(tmp_path):
    # The architecture is model_type's qwen3_vl; the preset names spell it qwen3-vl.
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["random", "qwen3_vl", "--preset", "tiny", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert ModelConfig.from_file(tmp_path).model_type == "qwen3_vl"
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]["patch_size"] == 4


def test_cli_refuses_to_quantize_a_vision_preset_in_one_line(tmp_path):
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    argv = [
        "random",
        "gemma3",
        "--preset",
        "gemma3-vision-tiny",
        "--out",
        str(tmp_path),
        "--quantization",
        "int8",
    ]
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit, match="has a vision tower; quantization is for text-only presets"):
        args.func(args)


def test_cli_writes_a_gptq_act_order_checkpoint_and_refuses_act_order_elsewhere(tmp_path):
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    out = tmp_path / "gptq"
    args = parser.parse_args(
        ["random", "qwen3", "--preset", "tiny", "--out", str(out), "--quantization", "gptq", "--act-order"]
    )
    assert args.func(args) == 0
    raw = ModelConfig.from_file(out).quantization
    assert (raw.method, raw.act_order, raw.symmetric, raw.zero_offset) == ("gptq", True, True, 1)
    args = parser.parse_args(
        [
            "random",
            "qwen3",
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "awq"),
            "--quantization",
            "awq",
            "--act-order",
        ]
    )
    with pytest.raises(SystemExit, match="needs --quantization gptq"):
        args.func(args)


def test_cli_rejects_a_preset_of_another_architecture(tmp_path):
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["random", "llama", "--preset", "qwen3-8b", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a llama preset; choose from llama-3.2-1b"):
        args.func(args)


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-1.7b", "gemma-3-1b"])
def test_a_real_shape_tokenizer_counts_common_english_as_a_real_tokenizer_does(preset, tmp_path):
    # Benchmarks size chat prompts in words (W3's system prompt: 768): one token per byte would
    # make them ~5x longer than on the real model. The oracle is SmolLM2's real tokenizer.
    from infer.models.loader.fetch import fetch_model

    vocab_size = PRESETS[preset].config["vocab_size"]
    _write_tokenizer(
        tmp_path, PRESETS[preset].arch, vocab_size, _special_tokens(PRESETS[preset].arch, vocab_size)
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    real = AutoTokenizer.from_pretrained(fetch_model("smollm2-135m-instruct"))
    assert len(tokenizer) == vocab_size
    for word in COMMON_WORDS:
        assert len(real.encode(" " + word, add_special_tokens=False)) == 1, word
        for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            assert len(tokenizer.encode(form, add_special_tokens=False)) == 1, form
    rng = random.Random(0)
    text = "Request 7: " + " ".join(rng.choice(COMMON_WORDS) for _ in range(768)) + ". Done?"
    ours, theirs = (len(t.encode(text, add_special_tokens=False)) for t in (tokenizer, real))
    assert abs(ours - theirs) <= 0.02 * theirs, (ours, theirs)
    other = "Paris, ça va? 東京 🙂 thereafter"  # words it does not know still round-trip, byte by byte
    assert tokenizer.decode(tokenizer.encode(other, add_special_tokens=False)) == other
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # Every id decodes alone to whole characters (fillers and words alike), bytes aside.
    specials = set(tokenizer.added_tokens_decoder)
    pieces = [tokenizer.decode([i]) for i in range(vocab_size) if i not in specials]
    assert sum("\ufffd" in piece for piece in pieces) <= 128  # the lone bytes 0x80-0xff


def test_gemma3_vision_tiny_loads_in_transformers_and_ours_with_the_same_image_features(tmp_path):
    folder = make_random_checkpoint("gemma3-vision-tiny", tmp_path, dtype=torch.float32)
    reference, info = Gemma3ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # Every weight random, the projector's too (transformers starts it at zero, which would hide it).
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    assert [name for name, tensor in stored.items() if not tensor.std() > 0] == []
    loaded = load_model(folder, dtype=torch.float32)
    assert loaded.model.vision is not None
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    pixels = AutoProcessor.from_pretrained(folder).image_processor(image, return_tensors="pt").pixel_values
    with torch.no_grad():
        expected = reference.model.get_image_features(pixels).pooler_output
    torch.testing.assert_close(loaded.model.vision(pixels), expected, atol=1e-5, rtol=0)


def test_gemma3_vision_tiny_tokenizer_spells_an_image_with_the_configs_token_ids(tmp_path):
    folder = make_random_checkpoint("gemma3-vision-tiny", tmp_path, weights=False)
    config = json.loads((folder / "config.json").read_text())
    boi, eoi, image = config["boi_token_index"], config["eoi_token_index"], config["image_token_index"]
    assert max(boi, eoi, image) < config["text_config"]["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The attributes through which transformers' Gemma3Processor finds them; special, as Gemma 3's.
    assert (tokenizer.boi_token_id, tokenizer.eoi_token_id, tokenizer.image_token_id) == (boi, eoi, image)
    assert all(tokenizer.added_tokens_decoder[token_id].special for token_id in (boi, eoi, image))
    layout = image_processor_for(folder, "gemma3").layout
    assert layout.image_token_id == image
    newline = tokenizer.encode("\n", add_special_tokens=False)
    expected = newline * 2 + [boi] + [image] * 16 + [eoi] + newline * 2
    assert tokenizer.encode(layout.expansion(16), add_special_tokens=False) == expected
    # tokenizer.json alone (what servers other than transformers read) spells it the same.
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert raw.encode(layout.expansion(16), add_special_tokens=False).ids == expected


def two_images() -> list[Image.Image]:
    """Of different sizes and aspect ratios: 30 and 8 tokens of qwen3-vl-tiny."""
    rng = np.random.default_rng(0)
    shapes = [(40, 50, 3), (30, 20, 3)]
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in shapes]


def test_qwen3_vl_tiny_loads_in_transformers_and_ours_with_the_same_image_features(tmp_path):
    folder = make_random_checkpoint("qwen3-vl-tiny", tmp_path, dtype=torch.float32)
    reference, info = Qwen3VLForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    assert [name for name, tensor in stored.items() if not tensor.std() > 0] == []
    assert any(name.startswith("model.visual.deepstack_merger_list.") for name in stored)
    loaded = load_model(folder, dtype=torch.float32)
    assert loaded.model.vision is not None
    # Each side's pixels from the checkpoint's preprocessor_config.json by its own processor.
    images = two_images()
    expected_inputs = AutoImageProcessor.from_pretrained(folder)(images, return_tensors="pt")
    ours = image_processor_for(folder, "qwen3_vl")
    with torch.no_grad():
        expected = reference.model.get_image_features(
            expected_inputs["pixel_values"], expected_inputs["image_grid_thw"]
        )
    got = loaded.model.vision.encode([ours(image)[0] for image in images])
    assert [len(embeds) for embeds in got] == [30, 8]
    for index, embeds in enumerate(got):
        # The merger's embedding, then each DeepStack level's, side by side (infer.models.qwen3_vl_vision).
        levels = [expected.pooler_output[index], *(level[index] for level in expected.deepstack_features)]
        torch.testing.assert_close(embeds, torch.cat(levels, dim=-1), atol=1e-5, rtol=0)


def test_qwen3_vl_tiny_tokenizer_spells_an_image_with_the_configs_token_ids(tmp_path):
    folder = make_random_checkpoint("qwen3-vl-tiny", tmp_path, weights=False)
    config = json.loads((folder / "config.json").read_text())
    start, end = config["vision_start_token_id"], config["vision_end_token_id"]
    image, video = config["image_token_id"], config["video_token_id"]
    assert max(start, end, image, video) < config["text_config"]["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The names by which Qwen3VLProcessor finds them; special, as Qwen's.
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    assert tokenizer.convert_tokens_to_ids(names) == [start, end, image, video]
    assert all(tokenizer.added_tokens_decoder[token_id].special for token_id in (start, end, image, video))
    layout = image_processor_for(folder, "qwen3_vl").layout
    assert layout.image_token_id == image
    expected = [start] + [image] * 30 + [end]
    assert tokenizer.encode(layout.expansion(30), add_special_tokens=False) == expected
    # tokenizer.json alone (what servers other than transformers read) spells it the same.
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert raw.encode(layout.expansion(30), add_special_tokens=False).ids == expected
