"""VLM-015: the released layouts (gemma-3-4b, qwen3-vl-4b; random weights that `infer models
random` writes) in bf16 on a CUDA GPU against transformers' own classes over the same folder;
VLM-016: the tiny presets through the same check in fp32 on the CPU.

Per checkpoint: the tower's features, the cache-less logits of prompts with 0, 1 and 3 images,
then the engine's greedy tokens (paged KV, chunks that cut the images, the prefix cache on) and
a repeat served from the cache with the encoder skipped. Random real-shape weights give flat
logits, so greedy tokens are held to transformers' up to a bf16 near tie, as PAR-021 holds the
text models (specs/parity/tolerances.yaml's greedy_tie).
"""

import dataclasses
import gc
import random

import pytest
import torch

from conformance.parity.checks import LogitGaps, _random_checkpoint, tolerances_by_dtype
from infer.models.forward_batch import ForwardBatch
from infer.models.vision import image_runs


@dataclasses.dataclass
class _Family:
    """How one family's prompt spells an image and how transformers is handed the pixels."""

    image_token: int
    before: int  # the token ahead of each placeholder run (Gemma's BOI, Qwen's vision_start)
    after: int
    pixels: list[torch.Tensor]  # what our tower and PromptImage take, one [3, H, W] per image
    tokens_per_image: list[int]
    device: str
    dtype: torch.dtype
    vocab_size: int
    # Ids a text token must not take: the image tokens, and Qwen's video ones, which transformers'
    # position code looks for in the prompt.
    reserved: set[int]

    def prompt(self, num_images: int, seed: int) -> list[int]:
        rng = random.Random(seed)

        def text(count: int) -> list[int]:
            tokens = []
            while len(tokens) < count:
                token = rng.randrange(4, self.vocab_size)
                if token not in self.reserved:
                    tokens.append(token)
            return tokens

        prompt = text(12)
        for index in range(num_images):
            prompt += [self.before, *[self.image_token] * self.tokens_per_image[index], self.after, *text(7)]
        return prompt


def _gemma3(reference, device: str, dtype: torch.dtype) -> _Family:
    config = reference.config
    size = config.vision_config.image_size
    generator = torch.Generator().manual_seed(3)
    return _Family(
        image_token=config.image_token_id,
        before=config.boi_token_id,
        after=config.eoi_token_id,
        pixels=[torch.randn(3, size, size, generator=generator) for _ in range(3)],
        tokens_per_image=[config.mm_tokens_per_image] * 3,
        device=device,
        dtype=dtype,
        vocab_size=config.text_config.vocab_size,
        reserved={config.image_token_id, config.boi_token_id, config.eoi_token_id},
    )


# Qwen3-VL's images in merge blocks (patch x merge pixels square: 32 in a release), square, tall
# and wide: 49, 70 and 30 image tokens.
_QWEN_BLOCKS = [(7, 7), (14, 5), (3, 10)]


def _qwen3_vl(reference, device: str, dtype: torch.dtype) -> _Family:
    config = reference.config
    block = config.vision_config.patch_size * config.vision_config.spatial_merge_size
    generator = torch.Generator().manual_seed(4)
    return _Family(
        image_token=config.image_token_id,
        before=config.vision_start_token_id,
        after=config.vision_end_token_id,
        pixels=[torch.randn(3, h * block, w * block, generator=generator) for h, w in _QWEN_BLOCKS],
        tokens_per_image=[h * w for h, w in _QWEN_BLOCKS],
        device=device,
        dtype=dtype,
        vocab_size=config.text_config.vocab_size,
        reserved={
            config.image_token_id,
            config.video_token_id,
            config.vision_start_token_id,
            config.vision_end_token_id,
        },  # fmt: skip
    )


def _reference_inputs(reference, family: _Family, prompt: list[int], num_images: int) -> dict:
    """transformers' forward arguments for the prompt and its first `num_images` images."""
    ids = torch.tensor([prompt], device=family.device)
    pixels = family.pixels[:num_images]
    vision = reference.config.vision_config
    if reference.config.model_type == "gemma3":
        inputs = {"input_ids": ids, "token_type_ids": (ids == family.image_token).long()}
        if pixels:
            inputs["pixel_values"] = torch.stack(pixels).to(family.device, family.dtype)
        return inputs
    from conformance.vlm.qwen3_vl import transformers_inputs

    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == family.image_token).int()}
    if pixels:
        patch, merge = vision.patch_size, vision.spatial_merge_size
        pixel_values, grids = transformers_inputs(pixels, patch, merge, vision.temporal_patch_size)
        inputs["pixel_values"] = pixel_values.to(family.device, family.dtype)
        inputs["image_grid_thw"] = grids.to(family.device)
    return inputs


def _reference_features(reference, family: _Family) -> list[torch.Tensor]:
    """Per image, transformers' get_image_features rows, DeepStack's levels beside the merger's."""
    inputs = _reference_inputs(reference, family, [family.image_token], 3)
    if reference.config.model_type == "gemma3":
        return list(reference.model.get_image_features(inputs["pixel_values"]).pooler_output)
    out = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    # Each DeepStack level: per image (a tuple), or every image's rows back to back (one tensor),
    # by transformers' version.
    levels = [
        level.split(family.tokens_per_image) if isinstance(level, torch.Tensor) else level
        for level in out.deepstack_features
    ]
    return [torch.cat([out.pooler_output[i], *(level[i] for level in levels)], dim=-1) for i in range(3)]


def _our_logits(model, family: _Family, prompt: list[int], num_images: int) -> torch.Tensor:
    """Our language model over our tower's rows, without a cache: [len(prompt), vocab]."""
    batch = ForwardBatch.from_tokens([prompt], device=family.device)
    pixels = family.pixels[:num_images]
    if pixels:
        tower = model.vision
        indices = torch.nonzero(torch.tensor(prompt) == family.image_token).flatten()
        extra = dict(
            image_embeds=torch.cat(tower.encode([p.to(family.device, family.dtype) for p in pixels])),
            image_token_indices=indices.to(family.device),
        )
        if tower.layout.bidirectional:  # each image's tokens see each other both ways
            groups = torch.full((len(prompt),), -1)
            for index, (offset, length) in enumerate(image_runs(prompt, family.image_token)):
                groups[offset : offset + length] = index
            extra["image_groups"] = groups.to(family.device)
        if hasattr(tower, "rope_positions"):
            extra["mrope_positions"] = tower.rope_positions(prompt, pixels)[0].to(family.device)
        batch = dataclasses.replace(batch, **extra)
    with torch.inference_mode():
        return model.compute_logits(model(batch)).float()


def _reference_greedy(reference, family: _Family, prompt: list[int], num_images: int, steps: int):
    """transformers' greedy tokens by whole forwards (no cache), and the logits of each step."""
    tokens, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            step = reference(**_reference_inputs(reference, family, tokens, num_images)).logits[0, -1].float()
            logits.append(step)
            tokens.append(int(step.argmax()))
    return tokens[len(prompt) :], logits


def _assert_greedy_up_to_a_tie(label: str, got, logprobs, expected, logits, bounds) -> None:
    """Equal tokens, each logprob within max_abs of transformers' log-softmax, until the first
    difference; there transformers' logits of the two tokens must be within greedy_tie."""
    for step, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        if ours != theirs:
            gap = (logits[step][theirs] - logits[step][ours]).item()
            assert gap <= bounds["greedy_tie"], (
                f"{label}: ours {got} vs transformers' {expected}: at step {step} transformers' "
                f"logits of the two differ by {gap:.3f}, above greedy_tie {bounds['greedy_tie']}"
            )
            return
        reference_logprob = logits[step].log_softmax(-1)[ours].item()
        assert abs(logprobs[step] - reference_logprob) <= bounds["max_abs"], (
            f"{label}: step {step} logprob {logprobs[step]:.3f} against transformers' {reference_logprob:.3f}"
        )


def real_shape_parity(case: dict, impl: str | None) -> None:
    """A preset's random checkpoint in the case's dtype and device: features, logits, engine tokens."""
    from transformers import AutoModelForImageTextToText

    from conformance.vlm.checks import _generate, _VisionCounts
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.engine.images import PromptImage
    from infer.models.load import load_model

    device, dtype = case["device"], case["dtype"]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bounds = tolerances_by_dtype()[dtype]
    folder = _random_checkpoint(case["preset"], dtype)
    reference = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    reference = reference.to(device).eval()
    make_family = _gemma3 if reference.config.model_type == "gemma3" else _qwen3_vl
    family = make_family(reference, device, getattr(torch, dtype))
    loaded = load_model(folder, dtype=family.dtype, device=device)
    try:
        # The tower: rows of the same shape, off by bf16 rounding over every layer.
        with torch.no_grad():
            expected = _reference_features(reference, family)
        got = loaded.model.vision.encode([p.to(family.device, family.dtype) for p in family.pixels])
        for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
            assert ours.shape == theirs.shape, f"image {index}: {tuple(ours.shape)} vs {tuple(theirs.shape)}"
            relative = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
            print(f"{case['preset']} image {index}: features' relative error {relative:.3g}")
            assert relative <= case["feature_error"], f"image {index}: relative error {relative:.3g}"
        # The language model over them, without a cache.
        for num_images in (0, 1, 3):
            prompt = family.prompt(num_images, seed=num_images)
            inputs = _reference_inputs(reference, family, prompt, num_images)
            with torch.no_grad():
                theirs = reference(**inputs).logits[0].float()
            gaps = LogitGaps()
            gaps.add(_our_logits(loaded.model, family, prompt, num_images), theirs)
            mean_abs, top1 = gaps.abs_sum / gaps.count, gaps.agree / gaps.positions
            label = f"{case['preset']}, {num_images} images: "
            print(f"{label}max_abs {gaps.max_abs:.3g}, mean_abs {mean_abs:.3g}, top-1 {top1:.3f}")
            gaps.assert_within(bounds, label)
            del theirs
        # The engine: chunks of 100 tokens cut every image; CUDA graphs for decode steps.
        config = EngineConfig(
            model=str(folder), device=device, dtype=dtype, block_size=16, max_num_batched_tokens=256,
            use_chunked_prefill=True, prefill_chunk_size=100, use_prefix_caching=True,
            use_cuda_graphs=device == "cuda", num_gpu_blocks=256, max_batch_size=8,
        )  # fmt: skip
        engine = Engine(config, loaded)
        steps = bounds["greedy_steps"]
        for num_images in (0, 1, 3):
            prompt = family.prompt(num_images, seed=10 + num_images)
            images = [
                PromptImage(offset, length, family.pixels[i], f"{num_images:08x}{i:08x}".ljust(64, "0"))
                for i, (offset, length) in enumerate(image_runs(prompt, family.image_token))
            ]
            expected, logits = _reference_greedy(reference, family, prompt, num_images, steps)
            for attempt in ("cold", "cached"):
                counts = _VisionCounts(engine)
                got, logprobs, final = _generate(engine, prompt, images, steps)
                label = f"{case['preset']}, {num_images} images ({attempt})"
                _assert_greedy_up_to_a_tie(label, got, logprobs, expected, logits, bounds)
                ran = num_images if attempt == "cold" else 0
                expected_counts = {"runs": ran, "skipped": num_images - ran}
                assert counts.delta() == expected_counts, f"{label}: the encoder {counts.delta()}"
                if attempt == "cached":
                    assert final.cached_tokens >= len(prompt) - 1, f"{label}: {final.cached_tokens} cached"
        engine.shutdown()
    finally:
        del reference, loaded
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
