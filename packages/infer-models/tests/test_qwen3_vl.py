"""Qwen3-VL (infer.models.qwen3_vl, qwen3_vl_vision, mrope) against transformers' own
Qwen3VLForConditionalGeneration, on a tiny random checkpoint that transformers writes: the
tower's features (DeepStack's included), the image processor, the M-RoPE positions, the logits
of prompts with images (cache-less) and greedy decoding."""

import dataclasses
import functools

import numpy as np
import pytest
import torch
from PIL import Image

from conformance.paged_batches import PagedRow, grow, paged_batch, scrambled_pool
from conformance.parity.checks import LogitGaps, tolerances_by_dtype
from conformance.vlm.qwen3_vl import (
    IMAGE_SIZES,
    IMAGE_TOKEN,
    MERGE,
    PATCH,
    TEMPORAL,
    VISION_END,
    VISION_START,
    prompt_with_images,
    reference_processor,
    tiny_qwen3_vl,
    transformers_inputs,
)
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
from infer.models.loader.weights import load_weights
from infer.models.mrope import decode_mrope_positions, mrope_positions
from infer.models.qwen3_vl import CHECKPOINT_PREFIXES, IGNORED_PREFIXES, Qwen3VLForCausalLM
from infer.models.qwen3_vl_vision import Qwen3VLImageProcessor, load_qwen3_vl_vision, patchify
from infer.models.vision import image_runs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@functools.cache
def our_model(device: str = "cpu") -> Qwen3VLForCausalLM:
    """Our language model over the tiny checkpoint, loaded as infer.models.load will once
    registry.py lists qwen3_vl (CHECKPOINT_PREFIXES, IGNORED_PREFIXES)."""
    folder, _ = tiny_qwen3_vl()
    config = ModelConfig.from_file(folder)
    with torch.device("meta"):
        model = Qwen3VLForCausalLM(config)
    load_weights(
        model,
        folder,
        config,
        dtype=torch.float32,
        device=device,
        prefixes=CHECKPOINT_PREFIXES,
        ignored_prefixes=IGNORED_PREFIXES,
    )
    return apply_kernel_policy(model.eval(), KernelPolicy(device))


@functools.cache
def our_tower(device: str = "cpu"):
    return load_qwen3_vl_vision(tiny_qwen3_vl()[0], device=device)


def random_pixels(num_images: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=generator) for h, w in IMAGE_SIZES[:num_images]]


def image_batch(prompt: list[int], pixels: list[torch.Tensor], grids, device: str = "cpu") -> ForwardBatch:
    """A cache-less batch of one prompt: the tower's rows at the image tokens, M-RoPE positions."""
    batch = ForwardBatch.from_tokens([prompt], device=device)
    if not pixels:
        return batch
    positions, _ = mrope_positions(prompt, grids, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)
    return dataclasses.replace(
        batch,
        image_embeds=torch.cat(our_tower(device).encode(pixels)),
        image_token_indices=torch.nonzero(torch.tensor(prompt) == IMAGE_TOKEN).flatten().to(device),
        mrope_positions=positions.to(device),
    )


def transformers_logits(prompt: list[int], pixels: list[torch.Tensor]) -> torch.Tensor:
    """transformers' forward with the pixels, mm_token_type_ids marking the image tokens."""
    _, reference = tiny_qwen3_vl()
    inputs = {}
    if pixels:
        pixel_values, image_grid_thw = transformers_inputs(pixels)
        inputs = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return reference(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), **inputs).logits[0]


@pytest.mark.parametrize("num_images", [1, 3])
def test_vision_features_equal_transformers(num_images):
    """Per image, the merger's embeddings then each DeepStack level's equal transformers'
    get_image_features (pooler_output, deepstack_features), images of different sizes at once."""
    folder, reference = tiny_qwen3_vl()
    pixels = random_pixels(num_images, seed=1)
    with torch.no_grad():
        expected = reference.model.get_image_features(*transformers_inputs(pixels))
    got = load_qwen3_vl_vision(folder).encode(pixels)
    assert len(got) == num_images
    for index, embeds in enumerate(got):
        levels = [expected.pooler_output[index], *(level[index] for level in expected.deepstack_features)]
        want = torch.cat(levels, dim=-1)
        assert embeds.shape == want.shape, f"image {index}: {tuple(embeds.shape)}, transformers' {want.shape}"
        max_abs = (embeds - want).abs().max().item()
        assert max_abs <= 1e-5, f"image {index}: max_abs {max_abs:.3g} against transformers' features"


@pytest.mark.parametrize(
    ("height", "width", "mode"),
    [
        (20, 30, "RGB"),  # below min_pixels: scaled up
        (200, 100, "RGB"),  # above max_pixels: scaled down
        (45, 61, "RGBA"),  # transparency over white
        (8, 300, "L"),  # grayscale, 1 : 37
        (64, 64, "RGB"),  # already a multiple of patch * merge
    ],
)
def test_preprocessing_equals_transformers_image_processor(height, width, mode):
    """Our pixels, cut into transformers' patches, equal Qwen2VLImageProcessorPil's pixel_values
    and image_grid_thw (transformers' Qwen3-VL processor without torchvision), and the token
    count is the grid's over merge**2."""
    folder, _ = tiny_qwen3_vl()
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    shape = (height, width, channels) if channels > 1 else (height, width)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8), mode=mode)
    expected = reference_processor()([image], return_tensors="pt")
    processor = Qwen3VLImageProcessor.from_folder(folder)
    pixels, num_tokens = processor(image)
    patches, grid = patchify(pixels, PATCH, MERGE, TEMPORAL)
    assert [list(grid)] == [list(processor.grid(pixels))] == expected["image_grid_thw"].tolist()
    assert num_tokens == int(expected["image_grid_thw"].prod()) // MERGE**2
    assert patches.shape == expected["pixel_values"].shape
    assert (patches - expected["pixel_values"]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_mrope_positions_equal_get_rope_index(num_images):
    """A prompt's (t, h, w) positions and rope_delta, images of different grids among text."""
    _, reference = tiny_qwen3_vl()
    grids = [tuple(grid) for grid in transformers_inputs(random_pixels(3, seed=2))[1].tolist()][:num_images]
    prompt = prompt_with_images(grids, seed=num_images)
    ids = torch.tensor([prompt])
    expected, expected_delta = reference.model.get_rope_index(
        ids, (ids == IMAGE_TOKEN).int(), torch.tensor(grids) if grids else None
    )
    positions, rope_delta = mrope_positions(
        prompt, grids, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE
    )
    assert torch.equal(positions, expected[:, 0])
    assert rope_delta == expected_delta.item()


def test_mrope_positions_refuse_a_grid_that_does_not_match_the_tokens():
    grid = (1, 4, 4)  # 4 tokens
    prompt = [20, VISION_START, *[IMAGE_TOKEN] * 3, VISION_END]
    with pytest.raises(ValueError, match="do not match the image grids"):
        mrope_positions(prompt, [grid], image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)


def test_three_equal_positions_rotate_as_plain_rope():
    """ForwardBatch.mrope_positions None means each token's position on all three axes."""
    model = our_model()
    batch = ForwardBatch.from_tokens([[11, 42, 7, 99, 250, 3]])
    triple = dataclasses.replace(batch, mrope_positions=batch.positions.expand(3, -1))
    with torch.inference_mode():
        assert torch.equal(model(triple), model(batch))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_logits_with_images_equal_transformers(num_images, device):
    """Our language model, without a cache, over the tower's rows and the M-RoPE positions,
    against transformers' forward with the pixels."""
    pixels = random_pixels(num_images, seed=7)
    grids = transformers_inputs(pixels)[1].tolist() if pixels else []
    prompt = prompt_with_images(grids, seed=num_images)
    model = our_model(device)
    with torch.inference_mode():
        got = model.compute_logits(model(image_batch(prompt, pixels, grids, device)))
    gaps = LogitGaps()
    gaps.add(got.cpu(), transformers_logits(prompt, pixels))
    gaps.assert_within(tolerances_by_dtype()["float32"], f"{num_images} images on {device}: ")


def test_a_batch_of_an_image_prompt_and_a_text_prompt_equals_transformers():
    """Two rows in one batch, as a step mixes requests: mrope_positions covers every token (the
    text row's on all three axes) and the image token indices point into the flat batch."""
    pixels = random_pixels(1, seed=5)
    grids = transformers_inputs(pixels)[1].tolist()
    text, with_image = prompt_with_images([], seed=8), prompt_with_images(grids, seed=9)
    alone = image_batch(with_image, pixels, grids)
    batch = ForwardBatch.from_tokens([text, with_image])
    batch = dataclasses.replace(
        batch,
        image_embeds=alone.image_embeds,
        image_token_indices=alone.image_token_indices + len(text),
        mrope_positions=torch.cat([batch.positions[: len(text)].expand(3, -1), alone.mrope_positions], dim=1),
    )
    model = our_model()
    with torch.inference_mode():
        got = batch.rows(model.compute_logits(model(batch)))
    gaps = LogitGaps()
    gaps.add(got[0], transformers_logits(text, []))
    gaps.add(got[1], transformers_logits(with_image, pixels))
    gaps.assert_within(tolerances_by_dtype()["float32"], "two rows: ")


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_over_a_paged_cache_equals_transformers(device):
    """As the engine will run it: the prompt in two chunks over a scrambled paged cache (block
    size 4), the first ending inside the second image; each chunk takes its slice of the image
    rows (DeepStack's with them), of the image token indices and of the M-RoPE positions."""
    pixels = random_pixels(3, seed=7)
    grids = transformers_inputs(pixels)[1].tolist()
    prompt = prompt_with_images(grids, seed=3)
    model = our_model(device)
    whole = image_batch(prompt, pixels, grids, device)
    second_image_offset, second_image_length = image_runs(prompt, IMAGE_TOKEN)[1]
    cut = second_image_offset + second_image_length // 2
    pool = scrambled_pool(model, 4, len(prompt))
    block_ids: list[int] = []
    grow(pool, block_ids, len(prompt), "prompt")
    chunks = []
    for start, end in ((0, cut), (cut, len(prompt))):
        in_chunk = (whole.image_token_indices >= start) & (whole.image_token_indices < end)
        batch = dataclasses.replace(
            paged_batch(pool, [PagedRow(block_ids, start, prompt[start:end])]),
            image_embeds=whole.image_embeds[in_chunk],
            image_token_indices=whole.image_token_indices[in_chunk] - start,
            mrope_positions=whole.mrope_positions[:, start:end],
        )
        with torch.inference_mode():
            chunks.append(model.compute_logits(model(batch)).cpu())
    gaps = LogitGaps()
    gaps.add(torch.cat(chunks), transformers_logits(prompt, pixels))
    gaps.assert_within(tolerances_by_dtype()["float32"], f"two chunks on {device}: ")


@pytest.mark.parametrize("num_images", [1, 3])
def test_greedy_tokens_equal_transformers_generate(num_images):
    """Each step re-runs the whole sequence without a cache: the prompt at its M-RoPE positions,
    each generated token at its index plus the prompt's rope_delta."""
    steps = 8
    _, reference = tiny_qwen3_vl()
    pixels = random_pixels(num_images, seed=11)
    pixel_values, grid_thw = transformers_inputs(pixels)
    grids = grid_thw.tolist()
    prompt = prompt_with_images(grids, seed=20 + num_images)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = reference.generate(
            input_ids=ids,
            mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            pixel_values=pixel_values,
            image_grid_thw=grid_thw,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    model = our_model()
    prompt_batch = image_batch(prompt, pixels, grids)
    _, rope_delta = mrope_positions(prompt, grids, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)
    tokens: list[int] = []
    for _ in range(steps):
        batch = ForwardBatch.from_tokens([prompt + tokens])
        later = decode_mrope_positions(batch.positions[len(prompt) :], rope_delta)
        batch = dataclasses.replace(
            batch,
            image_embeds=prompt_batch.image_embeds,
            image_token_indices=prompt_batch.image_token_indices,
            mrope_positions=torch.cat([prompt_batch.mrope_positions, later], dim=1),
            logits_indices=torch.tensor([len(prompt) + len(tokens) - 1]),
        )
        with torch.inference_mode():
            tokens.append(int(model.compute_logits(model(batch)).argmax(-1)))
    assert tokens == generated
