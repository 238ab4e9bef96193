"""Hugging Face checkpoints with random weights: real shapes for GPU tests and benchmarks without
downloading, and tiny shapes for fast CPU tests.

A checkpoint is what transformers itself loads: config.json (written by transformers' own config
class), safetensors (one file, or shards with an index), generation_config.json, and a byte-level
tokenizer whose vocabulary size equals the model's, with the family's special tokens at their
real ids; where the vocabulary has room (every real shape), the most common English words are one
token each, as they are in the real tokenizers, so a benchmark's text has the token count it would
have on the real model. Tensors are streamed to disk one at a time, so an 8B preset needs ~1 tensor
of memory.

A multimodal Gemma 3 preset (`Preset.vision`) is a `Gemma3ForConditionalGeneration` checkpoint:
the SigLIP tower and the projector are random too, the tokenizer has the image tokens
(`<start_of_image>`, `<end_of_image>`, `<image_soft_token>`) where config.json says they are, and
preprocessor_config.json and processor_config.json are what Gemma 3's processor reads.

A Qwen3-VL preset (arch "qwen3_vl") is a `Qwen3VLForConditionalGeneration` checkpoint: the
vision tower and its mergers (DeepStack's too) are random, the tokenizer has `<|vision_start|>`,
`<|vision_end|>`, `<|image_pad|>` and `<|video_pad|>` at their real ids relative to the other Qwen
specials (inside the vocabulary at every size, where config.json says they are), and
preprocessor_config.json is what Qwen's image processor reads (patch, merge and temporal patch
sizes; the min and max pixels an image is resized between; mean and std).

With `quantization`, the attention and MLP projections are written 8-bit in the layouts of the
published checkpoints (see infer.models.quantization): "fp8" as Qwen3-8B-FP8 (float8_e4m3fn
weights, float32 `weight_scale_inv` per 128x128 block), "int8" as compressed-tensors w8a8
(int8 weights, float32 `weight_scale` [out, 1]); embeddings, norms and the LM head stay in
`dtype`. Each is the same random weight a dense checkpoint of the same seed holds, quantized.
"gptq" and "awq" write them 4-bit (infer.models.int4_weights' packers), as GPTQModel and AutoAWQ
do: int32 `qweight` and `qzeros`, float16 `scales` (GPTQ: `g_idx` too), groups of 128 columns (or
the largest power of two below that divides every projection's inputs, for tiny shapes),
rounded to nearest; GPTQ symmetric in its v1 format unless `quantization_config` (merged into
the written one) says `sym: false`, `checkpoint_format: "gptq_v2"` or `desc_act: true` (then each
Linear's columns are grouped in a random order, one per input: q, k and v share theirs, as gate
and up do).
"""

import argparse
import itertools
import json
import math
import string
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.models.config import TORCH_DTYPES
from infer.models.int4_weights import pack_awq, pack_gptq, quantize_int4_unpacked
from infer.models.quantization import (
    DEFAULT_BLOCKS,
    FP8_BLOCK,
    INT4_GROUP,
    SCALE_NAMES,
    WEIGHT_DTYPES,
    Quantization,
    quantize_weight,
    scale_shape,
)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Qwen3-VL's rotation: head_dim // 2 frequencies split among (t, h, w), interleaved.
_QWEN3_VL_ROPE = {
    "rope_type": "default",
    "rope_theta": 5e6,
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
}


@dataclass(frozen=True)
class Preset:
    arch: str  # "llama", "qwen3", "gemma3" or "qwen3_vl"
    # Keyword arguments of the transformers config class (of the language model's for a
    # multimodal model: Gemma3TextConfig, Qwen3VLTextConfig).
    config: dict = field(default_factory=dict)
    # A multimodal model: the keyword arguments of its vision_config (Gemma 3's SigLIP,
    # Qwen3VLVisionConfig); None for a text-only model.
    vision: dict | None = None
    # Placeholder tokens per image (Gemma3Config's mm_tokens_per_image): the tower's patches,
    # average-pooled to this many.
    mm_tokens_per_image: int = 256
    # Qwen3-VL's image processor: the (min, max) pixels an image is resized between, which bound
    # its token count (pixels / (patch * merge)**2). The releases': 256 x 256 to 4096 x 4096.
    image_pixels: tuple[int, int] = (256 * 256, 4096 * 4096)


def _llama(**shape) -> Preset:
    base = dict(rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5)
    return Preset("llama", {**base, **shape})


def _qwen3(**shape) -> Preset:
    base = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960)
    return Preset("qwen3", {**base, "rms_norm_eps": 1e-6, **shape})


def _gemma3(**shape) -> Preset:
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    return Preset("gemma3", {"rope_parameters": rope, "rms_norm_eps": 1e-6, **shape})


def _gemma3_vision(vision: dict, mm_tokens_per_image: int, **shape) -> Preset:
    text = _gemma3(**shape)
    # Gemma 3's SigLIP (so400m in every release): tanh GELU, and no pooling head, since the
    # projector pools the patches itself.
    vision = {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False, **vision}
    return Preset("gemma3", text.config, vision=vision, mm_tokens_per_image=mm_tokens_per_image)


def _qwen3_vl(vision: dict, image_pixels: tuple[int, int] = Preset.image_pixels, **shape) -> Preset:
    # The releases' tower: tanh GELU, 2 x 2 patches merged into a token, frames in pairs.
    text = dict(rope_parameters=_QWEN3_VL_ROPE, rms_norm_eps=1e-6, max_position_embeddings=262144)
    text |= shape
    vision = {"hidden_act": "gelu_pytorch_tanh", "spatial_merge_size": 2, "temporal_patch_size": 2, **vision}
    return Preset("qwen3_vl", text, vision=vision, image_pixels=image_pixels)


def _gemma_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


PRESETS: dict[str, Preset] = {
    # Shapes of the published checkpoints' config.json.
    "llama-3.2-1b": _llama(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "llama-3.2-3b": _llama(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": _llama(
        rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}, vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=False,
    ),
    "llama-3.1-70b": _llama(
        rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}, vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=False,
    ),
    "qwen3-1.7b": _qwen3(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "qwen3-4b": _qwen3(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "qwen3-8b": _qwen3(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "gemma-3-1b": _gemma3(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=_gemma_layer_types(26), max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "gemma-3-4b": _gemma3_vision(  # gemma-3-4b-it; heads, head_dim, vocabulary: Gemma3TextConfig's defaults
        vision=dict(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
            image_size=896, patch_size=14,
        ),
        mm_tokens_per_image=256, vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, layer_types=_gemma_layer_types(34),
        max_position_embeddings=131072, tie_word_embeddings=True,
        # The release's rope_scaling (linear, factor 8) applies to the global layers only.
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    # Qwen3-VL-4B-Instruct and -8B-Instruct: Qwen3-4B's and -8B's language models with a 256K
    # context, and towers of two sizes.
    "qwen3-vl-4b": _qwen3_vl(
        vision=dict(
            depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
            out_hidden_size=2560, num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
        ),
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "qwen3-vl-8b": _qwen3_vl(
        vision=dict(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
            out_hidden_size=4096, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
        ),
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    # Tiny shapes for CPU tests; each exercises what its family does unusually.
    "llama-tiny": _llama(  # untied head, Llama 3 rope scaling that bites at short range, GQA 4:2
        rope_parameters={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 64},
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
    "qwen3-tiny": _qwen3(  # head_dim larger than hidden / heads, as Qwen 3 has
        vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=256,
    ),
    "gemma3-tiny": _gemma3(  # window 4 bites on short prompts; both layer types; soft-capped logits
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0, max_position_embeddings=256, tie_word_embeddings=True,
    ),
    # gemma3-tiny's text model with a window of 16, an image's tokens (the tokens of one image
    # attend to each other both ways, which a window shorter than the image would cut), and no
    # logit soft-capping, as the multimodal releases have none (transformers'
    # Gemma3ForConditionalGeneration ignores it). A 32 x 32 image is 8 x 8 patches of 4, pooled
    # to 4 x 4 tokens.
    "gemma3-vision-tiny": _gemma3_vision(
        vision=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=32, patch_size=4,
        ),
        mm_tokens_per_image=16, vocab_size=384, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    # qwen3-tiny's text model, 3 layers, with M-RoPE (16 frequencies: 6 on t, 5 on h, 5 on w, as
    # the releases' 24/20/20 of 64) and a tower of 3 blocks whose first two feed DeepStack (the
    # last does not, as in the releases), over 4-pixel patches on an 8 x 8 table of learned
    # positions. An image is resized to between 16 x 16 and 48 x 48 pixels: 4 to 36 tokens.
    "qwen3-vl-tiny": _qwen3_vl(
        vision=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
            out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
        ),
        image_pixels=(16 * 16, 48 * 48), vocab_size=384, hidden_size=64, intermediate_size=160,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={**_QWEN3_VL_ROPE, "mrope_section": [6, 5, 5]}, max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
}  # fmt: skip

_TORCH_TO_SAFETENSORS = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.float8_e4m3fn: "F8_E4M3",
}
# What `make_random_checkpoint` writes: the 8-bit formats and the published 4-bit ones.
RANDOM_QUANTIZATIONS = ("fp8", "int8", "gptq", "awq")
# What a published checkpoint of each format writes into config.json.
QUANTIZATION_CONFIGS = {
    "fp8": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    },
    "int8": {
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "int",
                },
                "targets": ["Linear"],
                "weights": {
                    "dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "channel",
                    "symmetric": True, "type": "int",
                },
            }
        },
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    },
    # GPTQModel's config (group_size set where written).
    "gptq": {
        "bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": False,
        "group_size": INT4_GROUP, "lm_head": False, "pack_dtype": "int32", "quant_method": "gptq",
        "static_groups": False, "sym": True, "true_sequential": True,
    },
    # AutoAWQ's.
    "awq": {
        "bits": 4, "group_size": INT4_GROUP, "modules_to_not_convert": None, "quant_method": "awq",
        "version": "gemm", "zero_point": True,
    },
}  # fmt: skip
# Checkpoint tensors of a 4-bit projection, the packed weight first.
INT4_TENSORS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
_QUANTIZED_PROJECTIONS = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
)  # fmt: skip


def make_random_checkpoint(
    arch_preset: str,
    out_dir: str | Path,
    *,
    shards: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    quantization: str | None = None,
    quantization_config: dict | None = None,
    weights: bool = True,
) -> Path:
    """Writes a random checkpoint of preset `arch_preset` (a key of PRESETS) into `out_dir`,
    its projections 8-bit when `quantization` is "fp8" or "int8", 4-bit when "gptq" or "awq"
    (`quantization_config`: entries that replace the written config's, see the module).
    `weights=False` writes all but the weights: a folder that `load_format="dummy"` loads
    (infer.models.load)."""
    if arch_preset not in PRESETS:
        raise ValueError(f"unknown preset {arch_preset!r}; presets: {', '.join(PRESETS)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if dtype not in TORCH_DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype}")
    if quantization is not None and quantization not in RANDOM_QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(RANDOM_QUANTIZATIONS)}, got {quantization!r}"
        )
    preset = PRESETS[arch_preset]
    if quantization is not None and preset.vision is not None:
        # The 8-bit layouts go by projection names, which the tower's share: they would quantize
        # the tower too, which the vision loader (infer.models.gemma3_vision) reads dense.
        raise ValueError(f"{arch_preset} has a vision tower; quantization is for text-only presets")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Weights of an earlier run would sit beside (and, for transformers, shadow) the new ones.
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()
    specials = _special_tokens(preset.arch, preset.config["vocab_size"], images=preset.vision is not None)
    hf_config = _hf_config(preset, specials, dtype)
    hf_config.save_pretrained(out)
    if preset.vision is not None:
        _write_image_processor(out, preset, hf_config)
    shapes = _tensor_shapes(hf_config)
    int4 = None
    if quantization is not None:
        # Added to the file, not the config object: transformers' model (which gives the tensor
        # shapes) would otherwise set up its own quantizer.
        config_path = out / "config.json"
        written = json.loads(config_path.read_text())
        raw = {**QUANTIZATION_CONFIGS[quantization], **(quantization_config or {})}
        if quantization in INT4_TENSORS:
            raw["group_size"] = _int4_group(shapes)
            int4 = _Int4Writer(quantization, raw, seed)
        written["quantization_config"] = raw
        config_path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(hf_config), indent=2) + "\n")
    _write_tokenizer(out, preset.arch, preset.config["vocab_size"], specials)
    if not weights:
        return out
    tensors = _tensor_specs(shapes, dtype, quantization, int4)
    _write_weights(out, tensors, preset.arch, shards=shards, seed=seed, quantization=quantization, int4=int4)
    return out


def _int4_group(shapes: dict[str, tuple[int, ...]]) -> int:
    """INT4_GROUP, halved until it divides every quantized projection's inputs."""
    group = INT4_GROUP
    while any(shape[1] % group for name, shape in shapes.items() if name.endswith(_QUANTIZED_PROJECTIONS)):
        group //= 2
    return group


@dataclass
class _Int4Writer:
    """How a 4-bit format's projections are written: `raw`, its quantization_config."""

    method: str  # "gptq" or "awq"
    raw: dict
    seed: int
    # Each projection's dense [out, in] shape, by its checkpoint name ("....q_proj.weight").
    dense_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def tensors(self, weight_name: str) -> list[str]:
        base = weight_name.removesuffix("weight")
        return [base + suffix for suffix in INT4_TENSORS[self.method]]

    def specs(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        (n, k), groups = shape, shape[1] // self.raw["group_size"]
        qweight = (k // 8, n) if self.method == "gptq" else (k, n // 8)
        specs = [(qweight, torch.int32), ((groups, n // 8), torch.int32), ((groups, n), torch.float16)]
        return specs + [((k,), torch.int32)] if self.method == "gptq" else specs

    def pack(self, weight_name: str, dense: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of `self.tensors(weight_name)` for the dense weight."""
        group = self.raw["group_size"]
        symmetric = self.method == "gptq" and self.raw.get("sym", True)
        perm = self._columns_order(weight_name, dense.shape[1])
        q, scales, zeros = quantize_int4_unpacked(dense[:, perm], group, torch.float16, symmetric=symmetric)
        if self.method == "awq":
            return list(pack_awq(q, scales, zeros).values())
        order = torch.argsort(perm)  # back to the checkpoint's columns, each with its group
        g_idx = (torch.arange(dense.shape[1]) // group)[order]
        zero_offset = 1 if self.raw.get("checkpoint_format", "gptq") == "gptq" else 0
        return list(pack_gptq(q[:, order], scales, zeros, g_idx, zero_offset=zero_offset).values())

    def _columns_order(self, weight_name: str, in_features: int) -> torch.Tensor:
        """GPTQ act-order's order of the columns (identity without desc_act): random, one per
        input (a layer's q, k and v share it, as gate and up do)."""
        if not (self.method == "gptq" and self.raw.get("desc_act")):
            return torch.arange(in_features)
        shared = (
            weight_name.replace("k_proj", "q_proj")
            .replace("v_proj", "q_proj")
            .replace("up_proj", "gate_proj")
        )
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(shared.encode()))
        return torch.randperm(in_features, generator=generator)


def _hf_config(preset: Preset, specials: "_Specials", dtype: torch.dtype):
    from transformers import (
        Gemma3Config,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen3Config,
        Qwen3VLConfig,
        Qwen3VLTextConfig,
    )

    config_class = {
        "llama": LlamaConfig, "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig, "qwen3_vl": Qwen3VLTextConfig,
    }[preset.arch]  # fmt: skip
    token_ids = dict(
        bos_token_id=specials.bos_id,
        eos_token_id=specials.eos_ids if len(specials.eos_ids) > 1 else specials.eos_ids[0],
        pad_token_id=specials.pad_id,
        dtype=str(dtype).removeprefix("torch."),
    )
    if preset.arch == "qwen3_vl":
        # transformers ties the LM head by the outer tie_word_embeddings; the releases' config.json
        # has it in both places.
        return Qwen3VLConfig(
            text_config=config_class(**preset.config, **token_ids),
            vision_config=preset.vision,
            image_token_id=specials.ids[_IMAGE_PAD],
            video_token_id=specials.ids[_VIDEO_PAD],
            vision_start_token_id=specials.ids[_VISION_START],
            vision_end_token_id=specials.ids[_VISION_END],
            tie_word_embeddings=preset.config["tie_word_embeddings"],
            **token_ids,
        )
    text_config = config_class(**preset.config, **token_ids)
    if preset.vision is None:
        return text_config
    return Gemma3Config(
        text_config=text_config,
        vision_config=preset.vision,
        mm_tokens_per_image=preset.mm_tokens_per_image,
        boi_token_index=specials.ids[_BOI],
        eoi_token_index=specials.ids[_EOI],
        image_token_index=specials.ids[_IMAGE_TOKEN],
        **token_ids,
    )


def _write_image_processor(out: Path, preset: Preset, hf_config) -> None:
    """preprocessor_config.json as transformers' image processor of the family writes it.

    Gemma 3: each image resized to the tower's input, SigLIP's 0.5 mean and std, pan-and-scan
    off; and the processor_config.json of the releases, which gives Gemma3Processor the image's
    token count. Qwen3-VL: the tower's patch, merge and temporal patch sizes, the preset's min and
    max pixels (`size`'s shortest_edge and longest_edge, as the releases name them), 0.5 mean and
    std, as Qwen3-VL's preprocessor_config.json has them."""
    if preset.arch == "qwen3_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = hf_config.vision_config
        min_pixels, max_pixels = preset.image_pixels
        Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size,
            merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        ).save_pretrained(out)
        return
    from transformers import Gemma3ImageProcessorPil

    size = hf_config.vision_config.image_size
    Gemma3ImageProcessorPil(
        size={"height": size, "width": size},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_pan_and_scan=False,
    ).save_pretrained(out)
    processor = {"image_seq_length": hf_config.mm_tokens_per_image, "processor_class": "Gemma3Processor"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def _generation_config(hf_config) -> dict:
    return {
        "bos_token_id": hf_config.bos_token_id,
        "eos_token_id": hf_config.eos_token_id,
        "pad_token_id": hf_config.pad_token_id,
    }


def _tensor_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every tensor the transformers model stores, from an allocation-free meta instance."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # A multimodal config's model (Qwen3VLForConditionalGeneration has no causal-LM mapping).
    auto_class = AutoModelForImageTextToText if hasattr(hf_config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto_class.from_config(hf_config)
    seen, shapes = set(), {}
    for name, tensor in model.state_dict().items():
        # Tied weights appear under both names; checkpoints store the first (the embedding).
        if id(tensor) in seen or (hf_config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        seen.add(id(tensor))
        shapes[name] = tuple(tensor.shape)
    return shapes


# A vision tower's LayerNorm modules whose names do not end in "norm" (SigLIP's, Qwen3-VL's
# blocks'), in the checkpoint's names and ours.
_LAYER_NORMS = frozenset({"layer_norm1", "layer_norm2", "post_layernorm", "norm1", "norm2"})


def random_tensor(name: str, shape: tuple[int, ...], arch: str, generator: torch.Generator) -> torch.Tensor:
    """A float32 random weight for the tensor called `name` (a checkpoint's name or ours: the
    rules go by its suffix), made on the generator's device."""
    device = generator.device
    module, _, leaf = name.rpartition(".")
    if module.rpartition(".")[2] in _LAYER_NORMS and leaf == "weight":
        # A vision tower's LayerNorms scale by w, in a Gemma 3 checkpoint too: w near 1.
        return 1.0 + 0.1 * torch.randn(shape, generator=generator, device=device)
    if name.endswith(("mm_soft_emb_norm.weight", "mm_soft_emb_norm")):
        # Gemma 3's projector norm is Gemma's RMSNorm, whoever loads it: w near 0.
        return 0.1 * torch.randn(shape, generator=generator, device=device)
    if name.endswith("norm.weight"):
        # Gemma scales by (1 + w): store w near 0. Others scale by w: store w near 1.
        noise = 0.1 * torch.randn(shape, generator=generator, device=device)
        return noise if arch == "gemma3" else 1.0 + noise
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=generator, device=device)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        # std 4 / sqrt(hidden): logits of std ~4 at every size, peaked like a trained model's
        # (no near-ties for greedy decoding), and one absolute tolerance fits every preset.
        return torch.randn(shape, generator=generator, device=device) * 4 * shape[-1] ** -0.5
    # fan_in**-0.5 keeps activations O(1) through the stack, so logits are peaked, not near-ties.
    # The fan-in of a Linear [out, in] is its last dimension, of a convolution [out, in, k, k]
    # all but its first, and of Gemma 3's projector, applied as x @ W [vision, text], its first.
    if name.endswith(("mm_input_projection_weight", "mm_input_projection")):
        fan_in = shape[0]
    else:
        fan_in = math.prod(shape[1:]) if len(shape) > 2 else shape[-1]
    return torch.randn(shape, generator=generator, device=device) * fan_in**-0.5


def _tensor_specs(
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    quantization: str | None,
    int4: "_Int4Writer | None",
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor written, in order: an 8-bit projection's scale follows it,
    a 4-bit one's tensors follow its packed weight."""
    specs = {}
    for name, shape in shapes.items():
        if quantization is None or not name.endswith(_QUANTIZED_PROJECTIONS):
            specs[name] = (shape, dtype)
            continue
        if int4 is not None:
            int4.dense_shapes[name] = shape
            specs.update(zip(int4.tensors(name), int4.specs(shape), strict=True))
            continue
        specs[name] = (shape, WEIGHT_DTYPES[quantization])
        scale_name = name.removesuffix("weight") + SCALE_NAMES[quantization]
        specs[scale_name] = (scale_shape(*shape, _block(quantization, shape[1])), torch.float32)
    return specs


def _block(quantization: str, in_features: int) -> tuple[int, int]:
    """The scale block a published checkpoint of this format has: 128x128, or one row (int8)."""
    return Quantization(quantization, DEFAULT_BLOCKS[quantization]).block_for(in_features)


def _write_weights(
    out: Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    arch: str,
    *,
    shards: int,
    seed: int,
    quantization: str | None,
    int4: "_Int4Writer | None" = None,
) -> None:
    # A weight and its scale stay in one shard and are made together: the scale is kept from its
    # weight's quantization until it is written, right after it (4-bit: the packed weight's
    # zero points, scales and g_idx after it).
    if int4 is not None:
        companions = tuple(f".{suffix}" for suffix in INT4_TENSORS[int4.method][1:])
        units = [[name] for name in specs if not name.endswith(companions)]
        for unit in units:
            if unit[0].endswith(".qweight"):
                unit.extend(int4.tensors(unit[0].removesuffix("qweight") + "weight")[1:])
    else:
        units = [[name] for name in specs if not name.endswith(tuple(SCALE_NAMES.values()))]
    for unit in units:
        if quantization is not None and int4 is None:
            scale_name = unit[0].removesuffix("weight") + SCALE_NAMES[quantization]
            if scale_name in specs:
                unit.append(scale_name)
    per_shard = -(-len(units) // shards)
    groups = [sum(units[i : i + per_shard], []) for i in range(0, len(units), per_shard)]
    generator = torch.Generator().manual_seed(seed)
    pending_scales: dict[str, torch.Tensor] = {}

    def make(name: str) -> torch.Tensor:
        if name in pending_scales:
            return pending_scales.pop(name)
        if int4 is not None and name.endswith(".qweight"):
            weight_name = name.removesuffix("qweight") + "weight"
            dense = random_tensor(weight_name, int4.dense_shapes[weight_name], arch, generator)
            qweight, *rest = int4.pack(weight_name, dense)
            pending_scales.update(zip(int4.tensors(weight_name)[1:], rest, strict=True))
            return qweight
        shape, dtype = specs[name]
        dense = random_tensor(name, shape, arch, generator)
        if dtype.itemsize != 1:
            return dense
        weight, scale = quantize_weight(dense, quantization, _block(quantization, shape[1]))
        pending_scales[name.removesuffix("weight") + SCALE_NAMES[quantization]] = scale
        return weight

    weight_map = {}
    for index, group in enumerate(groups):
        file_name = (
            "model.safetensors" if shards == 1 else f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        _stream_safetensors(out / file_name, {n: specs[n] for n in group}, make)
        weight_map.update(dict.fromkeys(group, file_name))
    if shards > 1:
        total_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs.values())
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _stream_safetensors(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], make) -> None:
    """Writes the safetensors format by hand (8-byte header length, JSON header, raw data) so
    that each tensor is made, written and freed in turn."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in specs.items():
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {
            "dtype": _TORCH_TO_SAFETENSORS[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, (_, dtype) in specs.items():
            f.write(make(name).to(dtype).contiguous().view(torch.uint8).numpy().tobytes())


# Qwen's vision tokens, by which Qwen3VLProcessor finds them (infer.models.qwen3_vl_vision spells
# them too; importing it here would close an import circle through loader.weights).
_VISION_START, _VISION_END = "<|vision_start|>", "<|vision_end|>"
_IMAGE_PAD, _VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"

# Gemma 3's image tokens, and the tokenizer attributes (tokenizer_config.json's
# extra_special_tokens) through which Gemma3Processor finds them.
_BOI, _EOI, _IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
_GEMMA_IMAGE_ATTRIBUTES = {"boi_token": _BOI, "eoi_token": _EOI, "image_token": _IMAGE_TOKEN}


@dataclass(frozen=True)
class _Specials:
    ids: dict[str, int]  # special token -> id
    bos_id: int | None
    eos_ids: list[int]
    pad_id: int | None
    add_bos: bool
    # Tokenizer attribute -> special token (tokenizer_config.json's extra_special_tokens).
    attributes: dict[str, str] = field(default_factory=dict)


def _special_tokens(arch: str, vocab_size: int, *, images: bool = False) -> _Specials:
    """The family's special tokens at the ids the real tokenizers give them (relative to the end of
    the vocabulary for Llama and Qwen, whose special tokens follow the merges). `images`: the
    image tokens too; Qwen's vision tokens follow its other specials, so they sit inside any
    vocabulary; Gemma 3's at their real ids where the vocabulary holds them, else at its last
    three ids."""
    if arch == "llama":
        base = vocab_size - 256  # 128000 in Llama 3
        ids = {
            "<|begin_of_text|>": base, "<|end_of_text|>": base + 1, "<|start_header_id|>": base + 6,
            "<|end_header_id|>": base + 7, "<|eom_id|>": base + 8, "<|eot_id|>": base + 9,
        }  # fmt: skip
        return _Specials(ids, base, [base + 1, base + 8, base + 9], base + 1, add_bos=True)
    if arch in ("qwen3", "qwen3_vl"):
        base = vocab_size - 293  # 151643 in Qwen 3
        ids = {"<|endoftext|>": base, "<|im_start|>": base + 1, "<|im_end|>": base + 2,
               "<think>": base + 24, "</think>": base + 25}  # fmt: skip
        if images:  # 151652, 151653, 151655, 151656
            ids |= {_VISION_START: base + 9, _VISION_END: base + 10, _IMAGE_PAD: base + 12,
                    _VIDEO_PAD: base + 13}  # fmt: skip
        return _Specials(ids, None, [base + 2, base], base, add_bos=False)
    ids = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106}
    if not images:
        return _Specials(ids, 2, [1, 106], 0, add_bos=True)
    image_ids = {_BOI: 255999, _EOI: 256000, _IMAGE_TOKEN: 262144}
    if max(image_ids.values()) >= vocab_size:
        image_ids = {_BOI: vocab_size - 3, _EOI: vocab_size - 2, _IMAGE_TOKEN: vocab_size - 1}
    ids |= image_ids
    return _Specials(ids, 2, [1, 106], 0, add_bos=True, attributes=_GEMMA_IMAGE_ATTRIBUTES)


# Added tokens that are not special in the real tokenizer: decoding keeps them (skip_special_tokens
# drops only special ones), so a server reads Qwen 3's thinking tags in the answer's text.
_TEXT_TOKENS = frozenset({"<think>", "</think>"})


# The most common English words. Real tokenizers give each one token, with a leading space and
# without (SmolLM2's does: test_random_checkpoint checks it), and so does the random tokenizer
# wherever its vocabulary has room. The benchmarks' chat text is drawn from these words.
_COMMON_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no more can said "
    "what out up them into time only new some could these two may first then do any like my now over "
    "such our man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three"
)
COMMON_WORDS = _COMMON_WORD_TEXT.split()


def _word_merges() -> tuple[list[str], list[tuple[str, str]]]:
    """The tokens and merges (in rank order) of a byte-level BPE trained on COMMON_WORDS, each
    lower-case and capitalised, with and without a leading space: after them, each such word is
    one token. A trained BPE, rather than hand-made merge chains, so that no merge made for one
    word (`t h` for "the") splits another ("Ġthe") into pieces that never merge."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [form for word in COMMON_WORDS for form in (word, word.capitalize())]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 20, min_frequency=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator([*words, *(" " + word for word in words)], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    # Merges are "a b" strings in older tokenizers' JSON, [a, b] pairs in newer.
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    by_id = sorted(model["vocab"], key=model["vocab"].__getitem__)
    return [token for token in by_id if len(token) > 1], merges


def _write_tokenizer(out: Path, arch: str, vocab_size: int, specials: _Specials) -> None:
    """A byte-level BPE (a token per byte, and where the vocabulary has room, merges that make
    each of COMMON_WORDS one token), padded with filler tokens to exactly `vocab_size`, so any
    text round-trips and every model id decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    taken = set(specials.ids.values())
    free_ids = (i for i in range(vocab_size) if i not in taken)
    vocab = {token: token_id for token, token_id in specials.ids.items()}
    for char in sorted(byte_chars):
        vocab[char] = next(free_ids)
    word_tokens, merges = _word_merges()
    if len(vocab) + len(word_tokens) > vocab_size // 2:
        word_tokens, merges = [], []  # a tiny test vocabulary: bytes only
    for token in word_tokens:
        vocab[token] = next(free_ids)
    # Fillers are 2- to 4-character strings of ASCII letters and digits (the byte-level alphabet
    # maps those bytes to themselves): any sequence of them decodes to valid UTF-8, as a real
    # vocabulary's tokens almost always do. Random bytes would not, and a random model's output
    # would then be text held back for an incomplete character, token after token, which is
    # nothing a real model does (benchmarks measure inter-token latency on this text).
    alphabet = string.ascii_letters + string.digits
    fillers = ("".join(chars) for length in (2, 3, 4) for chars in itertools.product(alphabet, repeat=length))
    unused_fillers = (filler for filler in fillers if filler not in vocab)  # "the" is a word already
    for token_id in free_ids:
        vocab[next(unused_fillers)] = token_id
    if len(vocab) != vocab_size:
        raise AssertionError(f"built {len(vocab)} tokens for vocab_size {vocab_size}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials.ids if t not in _TEXT_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in specials.ids if t in _TEXT_TOKENS]
    )
    bos = next((t for t, i in specials.ids.items() if i == specials.bos_id), None)
    if specials.add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials.bos_id)]
        )
    tokenizer.save(str(out / "tokenizer.json"))
    by_id = {i: t for t, i in specials.ids.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": by_id[specials.eos_ids[0]],
        "pad_token": by_id.get(specials.pad_id),
        "add_bos_token": specials.add_bos,
        "model_max_length": 131072,
    }
    if specials.attributes:
        tokenizer_config["extra_special_tokens"] = specials.attributes
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Adds `random ARCH --preset P --out DIR [--shards N] [--seed S] [--dtype D] [--quantization Q]
    [--act-order]`."""
    parser = subparsers.add_parser("random", help="write a random-weight checkpoint with real or tiny shapes")
    parser.add_argument("arch", choices=sorted({p.arch for p in PRESETS.values()}))
    parser.add_argument("--preset", required=True, help=f"one of {', '.join(PRESETS)} (or 'tiny')")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="bfloat16")
    parser.add_argument(
        "--quantization",
        choices=RANDOM_QUANTIZATIONS,
        default=None,
        help="write the attention and MLP projections 8-bit: fp8 (128x128 blocks, as Qwen3-8B-FP8) or "
        "int8 (per channel, compressed-tensors); or 4-bit: gptq (GPTQModel's v1 format, symmetric) or "
        "awq (AutoAWQ's gemm), groups of 128",
    )
    parser.add_argument(
        "--act-order",
        action="store_true",
        help="with --quantization gptq: desc_act, each Linear's columns grouped in a random order",
    )
    parser.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    # Preset names spell the family with hyphens: `qwen3_vl --preset tiny` is qwen3-vl-tiny.
    name = args.preset if args.preset in PRESETS else f"{args.arch.replace('_', '-')}-{args.preset}"
    if name not in PRESETS or PRESETS[name].arch != args.arch:
        names = [n for n, p in PRESETS.items() if p.arch == args.arch]
        raise SystemExit(
            f"preset {args.preset!r} is not a {args.arch} preset; choose from {', '.join(names)}"
        )
    if args.act_order and args.quantization != "gptq":
        raise SystemExit("--act-order is GPTQ's desc_act: it needs --quantization gptq")
    try:
        out = make_random_checkpoint(
            name,
            args.out,
            shards=args.shards,
            seed=args.seed,
            dtype=TORCH_DTYPES[args.dtype],
            quantization=args.quantization,
            quantization_config={"desc_act": True} if args.act_order else None,
        )
    except ValueError as error:  # a setting the preset cannot take: one line, as the CLI's mistakes
        raise SystemExit(str(error)) from None
    quantized = f", {args.quantization} projections" if args.quantization else ""
    print(f"wrote {name} with random weights{quantized} to {out}")
    return 0
