"""A tiny random Qwen3-VL checkpoint that transformers itself writes, once per session, and the
prompts and pixel layouts of its reference: the oracle of specs/vlm's Qwen3-VL clauses and of
infer-models' Qwen3-VL tests (every weight random; a byte-level tokenizer so that the engine
loads the folder)."""

import atexit
import functools
import random
import shutil
import tempfile
from pathlib import Path

import torch

from infer.models.qwen3_vl_vision import patchify

PATCH, MERGE, TEMPORAL = 4, 2, 2
IMAGE_TOKEN, VISION_START, VISION_END = 5, 7, 8
MIN_PIXELS, MAX_PIXELS = 32 * 32, 96 * 96
# (height, width) of the pixels the tower takes: multiples of PATCH * MERGE, grids of patches
# both smaller and larger than the 8 x 8 learned positions, square, wide and tall.
IMAGE_SIZES = [(40, 56), (16, 16), (72, 24)]


@functools.cache
def tiny_qwen3_vl() -> tuple[Path, "torch.nn.Module"]:
    """(checkpoint folder, transformers' Qwen3VLForConditionalGeneration over it, eval mode):
    3 decoder layers, 3 vision blocks with DeepStack after blocks 0 and 2, an image processor of
    4-pixel patches."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=300,
            max_position_embeddings=512,
            # 16 frequencies: 6 on t, 5 on h, 5 on w, as a release's 24/20/20 of 64.
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]},
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=TEMPORAL,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 2],
        ),
        # Inside the tiny vocabulary (a release's image token, 151655, lies past its table).
        image_token_id=IMAGE_TOKEN,
        video_token_id=6,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # scales near 1, as trained ones
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            elif name == "lm_head.weight":  # logits of std about 4, as a trained model's
                parameter.copy_(torch.randn_like(parameter) * 4 * parameter.shape[1] ** -0.5)
            else:
                parameter.copy_(torch.randn_like(parameter) * 0.2)
    folder = Path(tempfile.mkdtemp(prefix="qwen3-vl-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.save_pretrained(folder)
    reference_processor().save_pretrained(folder)
    from infer.models.random_checkpoint import _special_tokens, _write_tokenizer

    _write_tokenizer(folder, "qwen3", 300, _special_tokens("qwen3", 300))
    return folder, model


def reference_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )


def transformers_inputs(
    pixels: list[torch.Tensor], patch: int = PATCH, merge: int = MERGE, temporal: int = TEMPORAL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of our pixels, in transformers' patch layout (the tiny
    checkpoint's patches unless told another tower's)."""
    patches, grids = zip(*(patchify(p, patch, merge, temporal) for p in pixels), strict=True)
    return torch.cat(patches), torch.tensor(grids)


def prompt_with_images(grids: list[tuple[int, int, int]], seed: int) -> list[int]:
    """Text, then per image vision_start, its placeholder tokens, vision_end and more text."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 300) for _ in range(6)]
    for t, h, w in grids:
        prompt += [VISION_START, *[IMAGE_TOKEN] * (t * h * w // MERGE**2), VISION_END]
        prompt += [rng.randrange(10, 300) for _ in range(4)]
    return prompt
