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
from infer.models.forward_batch import ForwardBatch
from infer.models.gemma3_vision import ImagePreprocessing, load_gemma3_vision
from infer.models.load import load_causal_lm

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
