"""Checks for specs/vlm: vision-language inputs against transformers and the refusals.

VLM-001 and VLM-002 compare with transformers on the tiny checkpoint of checkpoints.py; VLM-003
makes data: URLs from images written here and feeds them to infer.server.media.
"""

import base64
import dataclasses
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from conformance.parity.checks import LogitGaps, tolerances_by_dtype
from conformance.vlm.checkpoints import (
    BOI_TOKEN,
    EOI_TOKEN,
    IMAGE_SIZE,
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    tiny_gemma3_vision,
)
from conformance.vlm.real_shapes import real_shape_parity  # noqa: F401  (VLM-015's check)
from infer.models.forward_batch import ForwardBatch
from infer.models.gemma3_vision import ImagePreprocessing, load_gemma3_vision
from infer.models.load import load_causal_lm
from infer.models.vision import image_runs

PARAM = "messages[0].content[0].image_url"


def vision_features(case: dict, impl: str | None) -> None:
    folder, reference = tiny_gemma3_vision()
    pixels = torch.randn(
        case["images"], 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = reference.model.get_image_features(pixels).pooler_output
    got = load_gemma3_vision(folder)(pixels)
    assert got.shape == expected.shape, f"{tuple(got.shape)} against transformers' {tuple(expected.shape)}"
    max_abs = (got - expected).abs().max().item()
    assert max_abs <= 1e-5, f"max_abs {max_abs:.3g} against transformers' image features"


def preprocessing(case: dict, impl: str | None) -> None:
    import transformers

    folder, _ = tiny_gemma3_vision()
    shape = (case["height"], case["width"], case["channels"])
    array = np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8)
    image = Image.fromarray(array, mode="RGBA" if case["channels"] == 4 else "RGB")
    reference = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    expected = reference([image], return_tensors="pt")["pixel_values"]
    got = ImagePreprocessing.from_folder(folder)([image])
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-6


def data_url_images(case: dict, impl: str | None) -> None:
    from infer.server.media import MAX_PIXELS, MediaError, MediaPolicy, load_image

    picture = Image.fromarray(np.random.default_rng(4).integers(0, 256, (5, 7, 3), dtype=np.uint8))

    def encoded(image: Image.Image, image_format: str) -> str:
        buffer = io.BytesIO()
        image.save(buffer, format=image_format)
        return base64.b64encode(buffer.getvalue()).decode()

    side = int(MAX_PIXELS**0.5) + 1
    payloads = {
        "png": encoded(picture, "PNG"),
        "empty": "",
        "not-base64": "!!!",
        "garbage": base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode(),
        "bmp": encoded(picture, "BMP"),
        "huge": encoded(Image.new("1", (side, side)), "PNG"),
    }
    url = f"data:image/png;base64,{payloads[case['kind']]}"
    if case["expect"] == "ok":
        decoded = load_image(url, PARAM, MediaPolicy())
        assert list(decoded.image.getdata()) == list(picture.getdata())
        return
    with pytest.raises(MediaError, match=case["expect"]) as refused:
        load_image(url, PARAM, MediaPolicy())
    assert refused.value.param == PARAM


def logits_with_images(case: dict, impl: str | None) -> None:
    """Text, then each image as boi, its tokens and eoi, then text again: our language model over
    the vision tower's embeddings, without a cache, against transformers' forward with the
    pixels (token_type_ids marking the image tokens, which attend to each other both ways)."""
    folder, reference = tiny_gemma3_vision()
    rng = random.Random(case["images"])
    prompt: list[int] = [rng.randrange(10, 300) for _ in range(9)]
    groups: list[int] = [-1] * len(prompt)
    for image in range(case["images"]):
        prompt += [BOI_TOKEN, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, EOI_TOKEN]
        groups += [-1, *[image] * TOKENS_PER_IMAGE, -1]
        text = [rng.randrange(10, 300) for _ in range(5)]
        prompt, groups = prompt + text, groups + [-1] * len(text)
    pixels = torch.randn(
        case["images"], 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(7)
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = reference(
            input_ids=ids,
            pixel_values=pixels if case["images"] else None,
            token_type_ids=(ids == IMAGE_TOKEN).long(),
        ).logits[0]
    model = load_causal_lm(folder, dtype=torch.float32)
    batch = ForwardBatch.from_tokens([prompt])
    if case["images"]:
        image_groups = torch.tensor(groups)
        batch = dataclasses.replace(
            batch,
            image_embeds=load_gemma3_vision(folder)(pixels).reshape(-1, model.config.hidden_size),
            image_token_indices=torch.nonzero(image_groups >= 0).flatten(),
            image_groups=image_groups,
        )
    with torch.inference_mode():
        got = model.compute_logits(model(batch))
    gaps = LogitGaps()
    gaps.add(got, expected)
    gaps.assert_within(tolerances_by_dtype()["float32"], f"{case['images']} images: ")


# -- through the engine ------------------------------------------------------------------------


def _prompt(num_images: int, seed: int, text_tokens: int = 9) -> tuple[list[int], list[int]]:
    """Text, then per image BOI, its placeholders and EOI and more text: (ids, each image's
    offset)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 300) for _ in range(text_tokens)]
    offsets = []
    for _ in range(num_images):
        offsets.append(len(prompt) + 1)
        prompt += [BOI_TOKEN, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, EOI_TOKEN]
        prompt += [rng.randrange(10, 300) for _ in range(5)]
    return prompt, offsets


def _pixels(num_images: int, seed: int) -> torch.Tensor:
    return torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _prompt_images(offsets: list[int], pixels: torch.Tensor, seed: int) -> list:
    """PromptImages over the placeholder runs; the fingerprint stands for the pixels' seed."""
    from infer.engine.images import PromptImage

    return [
        PromptImage(offset, TOKENS_PER_IMAGE, pixels[index], f"{seed:08x}{index:08x}".ljust(64, "0"))
        for index, offset in enumerate(offsets)
    ]


def _reference_greedy(prompt: list[int], pixels: torch.Tensor, steps: int, device: str, dtype):
    """transformers' greedy tokens and each step's log-softmax (fp32) for the prompt and images."""
    _, reference = tiny_gemma3_vision()
    model = reference.to(device=device, dtype=dtype)
    ids = torch.tensor([prompt], device=device)
    extra = {}
    if len(pixels):
        extra = dict(pixel_values=pixels.to(device, dtype), token_type_ids=(ids == IMAGE_TOKEN).long())
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, max_new_tokens=steps, do_sample=False, output_scores=True,
            return_dict_in_generate=True, **extra,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [score[0].float().log_softmax(-1).cpu() for score in out.scores]


def _vlm_engine(device: str, dtype: str, **settings):
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.load import load_model

    folder, _ = tiny_gemma3_vision()
    loaded = load_model(folder, dtype=getattr(torch, dtype), device=device)
    # A pool of its own size: a default one takes most of a GPU's free memory, which the
    # allocator then holds from every other test process.
    config = dict(
        block_size=4,
        max_num_batched_tokens=64,
        use_prefix_caching=True,
        use_cuda_graphs=False,
        num_gpu_blocks=512,
    )
    config.update(settings)
    return Engine(EngineConfig(model=str(folder), device=device, dtype=dtype, **config), loaded)


def _greedy_params(steps: int):
    from infer.engine.sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=0)


def _generate(engine, prompt, images, steps: int):
    """Our greedy tokens, each one's logprob, and the request's final output fields."""
    from conformance.engine_runs import run_to_completion

    request_id = engine.add_request(prompt, _greedy_params(steps), images=images)
    outputs = run_to_completion(engine)[request_id]
    assert outputs[-1].error is None, outputs[-1].error
    tokens = [output for output in outputs if output.token_id is not None]
    return [o.token_id for o in tokens], [o.logprobs.logprob for o in tokens], outputs[-1]


def engine_greedy_with_images(case: dict, impl: str | None) -> None:
    """Prompts with 0, 1 and 3 images through the engine (paged KV, chunked prefill in chunks that
    would cut the images, the prefix cache on) give transformers' greedy tokens, each one's
    logprob within the dtype's bound of transformers' log-softmax."""
    device, dtype = case.get("device", "cpu"), case.get("dtype", "float32")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bounds = tolerances_by_dtype()[dtype]
    steps = min(8, bounds["greedy_steps"])
    settings = dict(use_chunked_prefill=True, prefill_chunk_size=case["chunk"], max_num_batched_tokens=64)
    if case.get("async"):  # the next step is scheduled and launched before this one's tokens are read
        settings["async_scheduling"] = True
    if case.get("ngram"):  # prompt lookup over a history that holds image placeholders
        settings["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        }  # fmt: skip
    engine = _vlm_engine(device, dtype, **settings)
    for num_images in (0, 1, 3):
        prompt, offsets = _prompt(num_images, seed=num_images)
        pixels = _pixels(num_images, seed=10 + num_images)
        expected, log_softmax = _reference_greedy(prompt, pixels, steps, device, getattr(torch, dtype))
        got, logprobs, _ = _generate(engine, prompt, _prompt_images(offsets, pixels, num_images), steps)
        assert got == expected, f"{num_images} images: {got} against transformers' {expected}"
        gaps = [
            abs(lp - step[token].item()) for lp, step, token in zip(logprobs, log_softmax, got, strict=True)
        ]
        assert max(gaps) <= bounds["max_abs"], f"{num_images} images: logprob gaps {gaps}"
    if case.get("ngram"):
        assert engine.stats().spec_decode_num_draft_tokens > 0, "no step speculated"


# -- the image-keyed prefix cache --------------------------------------------------------------


class _VisionCounts:
    """The engine's vision counters, read before and after a request (EngineStats' vision_*)."""

    def __init__(self, engine):
        self.engine = engine
        self.before = self._read()

    def _read(self) -> dict:
        stats = self.engine.stats()
        return {"runs": stats.vision_encoder_runs, "skipped": stats.vision_encoder_skipped}

    def delta(self) -> dict:
        after = self._read()
        return {key: after[key] - self.before[key] for key in after}


def _cached_run(engine, prompt, images, steps: int = 6):
    """(tokens, logprobs, prompt tokens the cache served, encoder runs and skips) of one request."""
    counts = _VisionCounts(engine)
    tokens, logprobs, final = _generate(engine, prompt, images, steps)
    return tokens, logprobs, final.cached_tokens, counts.delta()


def _check_against_reference(prompt, pixels, tokens, logprobs) -> None:
    expected, log_softmax = _reference_greedy(prompt, pixels, len(tokens), "cpu", torch.float32)
    assert tokens == expected, f"{tokens} against transformers' {expected}"
    gaps = [abs(lp - step[t].item()) for lp, step, t in zip(logprobs, log_softmax, tokens, strict=True)]
    assert max(gaps) <= tolerances_by_dtype()["float32"]["max_abs"], f"logprob gaps {gaps}"


def same_image_repeated(case: dict, impl: str | None) -> None:
    """A conversation with an image, then the same one again (or extended by more text): the
    second is a prefix-cache hit through the image and never runs the encoder, and its tokens are
    transformers'."""
    engine = _vlm_engine("cpu", "float32", use_chunked_prefill=True, prefill_chunk_size=20)
    prompt, offsets = _prompt(1, seed=21)
    pixels = _pixels(1, seed=22)
    _cached_run(engine, prompt, _prompt_images(offsets, pixels, 22))
    again = prompt + [rng_token for rng_token in range(40, 40 + case["more_text"])]
    tokens, logprobs, cached, counts = _cached_run(engine, again, _prompt_images(offsets, pixels, 22))
    image_end = offsets[0] + TOKENS_PER_IMAGE
    assert cached >= image_end, f"{cached} prompt tokens from the cache; the image ends at {image_end}"
    assert counts == {"runs": 0, "skipped": 1}, f"the encoder {counts} for a cached image"
    _check_against_reference(again, pixels, tokens, logprobs)


def different_image(case: dict, impl: str | None) -> None:
    """The same text with another image: the cache serves exactly the tokens before that image's
    placeholders (the image's fingerprint parts the keys there), the encoder runs for it, and the
    tokens are transformers' for the new image."""
    engine = _vlm_engine("cpu", "float32", use_chunked_prefill=True, prefill_chunk_size=20)
    prompt, offsets = _prompt(case["images"], seed=31)
    first = _pixels(case["images"], seed=32)
    _cached_run(engine, prompt, _prompt_images(offsets, first, 32))
    second = first.clone()
    changed = case["changed"]
    second[changed] = _pixels(1, seed=33)[0]
    images = _prompt_images(offsets, first, 32)
    images[changed] = _prompt_images(offsets, second, 33)[changed]
    tokens, logprobs, cached, counts = _cached_run(engine, prompt, images)
    assert cached == offsets[changed], (
        f"{cached} prompt tokens from the cache; the changed image starts at {offsets[changed]}"
    )
    assert counts["runs"] == case["images"] - changed, f"the encoder {counts}"
    _check_against_reference(prompt, second, tokens, logprobs)


def text_follow_up(case: dict, impl: str | None) -> None:
    """An image in the first user turn, the answer, then a text-only follow-up that repeats the
    conversation: the cache serves everything through the answer, the encoder does not run."""
    engine = _vlm_engine("cpu", "float32", use_chunked_prefill=True, prefill_chunk_size=20)
    prompt, offsets = _prompt(1, seed=41)
    pixels = _pixels(1, seed=42)
    images = _prompt_images(offsets, pixels, 42)
    answer, _, _, _ = _cached_run(engine, prompt, images)
    follow_up = prompt + answer + [random.Random(43).randrange(10, 300) for _ in range(7)]
    tokens, logprobs, cached, counts = _cached_run(engine, follow_up, images)
    # The answer's last token was sampled, never fed back: its K/V is the one not cached.
    through_answer = len(prompt) + len(answer) - 1
    assert cached >= through_answer, (
        f"{cached} prompt tokens from the cache, the answer ends at {through_answer}"
    )
    assert counts == {"runs": 0, "skipped": 1}, f"the encoder {counts}"
    _check_against_reference(follow_up, pixels, tokens, logprobs)


def encoder_runs(case: dict, impl: str | None) -> None:
    """A text-only conversation runs no encoder and is cached as a text model's is; a message of
    several images runs the encoder once for each."""
    engine = _vlm_engine("cpu", "float32", use_chunked_prefill=True, prefill_chunk_size=20)
    prompt, offsets = _prompt(case["images"], seed=51)
    pixels = _pixels(case["images"], seed=52)
    images = _prompt_images(offsets, pixels, 52)
    tokens, logprobs, cached, counts = _cached_run(engine, prompt, images)
    assert cached == 0 and counts == {"runs": case["images"], "skipped": 0}, f"the encoder {counts}"
    _check_against_reference(prompt, pixels, tokens, logprobs)
    _, _, cached, counts = _cached_run(engine, prompt + [77, 78], images)
    assert cached >= len(prompt) - 1, f"{cached} of {len(prompt)} prompt tokens from the cache"
    assert counts == {"runs": 0, "skipped": case["images"]}, f"the encoder {counts} on a repeat"


# -- Qwen3-VL through the engine -----------------------------------------------------------------


def _qwen3_vl_reference(prompt, pixels, steps: int, device: str, dtype):
    """transformers' greedy tokens and per-step log-softmax for Qwen3-VL."""
    from conformance.vlm import qwen3_vl

    _, reference = qwen3_vl.tiny_qwen3_vl()
    model = reference.to(device=device, dtype=dtype)
    ids = torch.tensor([prompt], device=device)
    extra = {}
    if pixels:
        pixel_values, grid_thw = qwen3_vl.transformers_inputs(pixels)
        extra = dict(pixel_values=pixel_values.to(device, dtype), image_grid_thw=grid_thw.to(device))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, mm_token_type_ids=(ids == qwen3_vl.IMAGE_TOKEN).int(), max_new_tokens=steps,
            min_new_tokens=steps, do_sample=False, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True, **extra,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [score[0].float().log_softmax(-1).cpu() for score in out.scores]


def qwen3_vl_engine_greedy(case: dict, impl: str | None) -> None:
    """Qwen3-VL prompts with 0, 1 and 3 images of different sizes through the engine (chunks that
    cut images, whose tokens attend causally; M-RoPE positions; the prefix cache on; then each
    prompt again, served from the cache with the encoder skipped): transformers' greedy tokens,
    each token's logprob within the dtype's bound."""
    from conformance.vlm import qwen3_vl
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.engine.images import PromptImage
    from infer.models.load import load_model

    device, dtype = case.get("device", "cpu"), case.get("dtype", "float32")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bounds = tolerances_by_dtype()[dtype]
    steps = min(8, bounds["greedy_steps"])
    folder, _ = qwen3_vl.tiny_qwen3_vl()
    loaded = load_model(folder, dtype=getattr(torch, dtype), device=device)
    config = EngineConfig(
        model=str(folder), device=device, dtype=dtype, block_size=4, max_num_batched_tokens=64,
        use_chunked_prefill=True, prefill_chunk_size=case["chunk"], use_prefix_caching=True,
        use_cuda_graphs=device == "cuda", num_gpu_blocks=512,
    )  # fmt: skip
    engine = Engine(config, loaded)
    for num_images in (0, 1, 3):
        generator = torch.Generator().manual_seed(60 + num_images)
        pixels = [torch.randn(3, h, w, generator=generator) for h, w in qwen3_vl.IMAGE_SIZES[:num_images]]
        grids = [(1, h // qwen3_vl.PATCH, w // qwen3_vl.PATCH) for h, w in qwen3_vl.IMAGE_SIZES[:num_images]]
        prompt = qwen3_vl.prompt_with_images(grids, seed=70 + num_images)
        runs = image_runs(prompt, qwen3_vl.IMAGE_TOKEN)
        images = [
            PromptImage(offset, length, pixels[i], f"{num_images:08x}{i:08x}".ljust(64, "0"))
            for i, (offset, length) in enumerate(runs)
        ]
        expected, log_softmax = _qwen3_vl_reference(prompt, pixels, steps, device, getattr(torch, dtype))
        for attempt in ("cold", "cached"):
            counts = _VisionCounts(engine)
            got, logprobs, final = _generate(engine, prompt, images, steps)
            assert got == expected, f"{num_images} images ({attempt}): {got} against transformers' {expected}"
            gaps = [abs(lp - s[t].item()) for lp, s, t in zip(logprobs, log_softmax, got, strict=True)]
            assert max(gaps) <= bounds["max_abs"], f"{num_images} images ({attempt}): logprob gaps {gaps}"
            if attempt == "cached":
                assert final.cached_tokens >= len(prompt) - 1, (
                    f"{final.cached_tokens} cached of {len(prompt)}"
                )
                assert counts.delta() == {"runs": 0, "skipped": num_images}, f"the encoder {counts.delta()}"


def large_images(case: dict, impl: str | None) -> None:
    """A 4K or 8K PNG sent as a data: URL is decoded, resized by the processor to what
    transformers' image processor gives, and answered through the engine with transformers'
    tokens for those pixels."""
    import transformers

    from infer.models.gemma3_vision import ImagePreprocessing
    from infer.server.media import MediaPolicy, load_image

    width, height = case["width"], case["height"]
    # A smooth picture: it compresses to a small file, and a resize of noise would hide nothing.
    x, y = np.meshgrid(
        np.linspace(0, 255, width, dtype=np.float32), np.linspace(0, 255, height, dtype=np.float32)
    )
    array = np.stack([x, y, (x + y) / 2], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    decoded = load_image(url, PARAM, MediaPolicy())
    assert decoded.image.size == (width, height)
    folder, _ = tiny_gemma3_vision()
    pixels = ImagePreprocessing.from_folder(folder)([decoded.image])
    reference = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    expected = reference([decoded.image], return_tensors="pt")["pixel_values"]
    assert pixels.shape == expected.shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert (pixels - expected).abs().max().item() <= 1e-6
    engine = _vlm_engine("cpu", "float32")
    prompt, offsets = _prompt(1, seed=81)
    tokens, logprobs, _ = _generate(engine, prompt, _prompt_images(offsets, pixels, 81), steps=4)
    _check_against_reference(prompt, pixels, tokens, logprobs)


def tensor_parallel_images(case: dict, impl: str | None) -> None:
    """Over two tensor-parallel ranks (a worker process, gloo on the CPU), each rank running the
    whole tower on the request's pixels: prompts with 0, 1 and 3 images give transformers'
    greedy tokens, each token's logprob within the fp32 bound, and a repeat is served from the
    cache with the encoder skipped."""
    from conformance.engine_runs import run_until_finished
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    folder, _ = tiny_gemma3_vision()
    config = EngineConfig(
        model=str(folder), device="cpu", dtype="float32", tensor_parallel_size=2, block_size=4,
        max_num_batched_tokens=64, use_chunked_prefill=True, prefill_chunk_size=20, use_prefix_caching=True,
    )  # fmt: skip
    engine = Engine(config)
    steps = 6
    try:
        for num_images in (0, 1, 3):
            prompt, offsets = _prompt(num_images, seed=90 + num_images)
            pixels = _pixels(num_images, seed=95 + num_images)
            expected, log_softmax = _reference_greedy(prompt, pixels, steps, "cpu", torch.float32)
            for attempt in ("cold", "cached"):
                counts = _VisionCounts(engine)
                request_id = engine.add_request(
                    prompt, _greedy_params(steps), images=_prompt_images(offsets, pixels, 90 + num_images)
                )
                outputs = run_until_finished(engine, [request_id])[request_id]
                assert outputs[-1].error is None, outputs[-1].error
                tokens = [o for o in outputs if o.token_id is not None]
                got = [o.token_id for o in tokens]
                assert got == expected, (
                    f"{num_images} images ({attempt}): {got} against transformers' {expected}"
                )
                gaps = [
                    abs(o.logprobs.logprob - s[o.token_id].item())
                    for o, s in zip(tokens, log_softmax, strict=True)
                ]
                assert max(gaps) <= tolerances_by_dtype()["float32"]["max_abs"], f"logprob gaps {gaps}"
                if attempt == "cached":
                    assert counts.delta() == {"runs": 0, "skipped": num_images}, (
                        f"the encoder {counts.delta()}"
                    )
    finally:
        engine.shutdown()
