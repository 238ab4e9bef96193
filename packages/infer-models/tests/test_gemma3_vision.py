"""Gemma 3's vision tower and projector (infer.models.gemma3_vision) against transformers'
`Gemma3ForConditionalGeneration.get_image_features`, on a tiny random checkpoint written by
transformers itself (every weight random, the projector's included): the image-token embeddings
within the fp32 parity bounds, for a batch of images."""

import shutil

import numpy as np
import pytest
import safetensors.torch
import torch

from conformance.parity.checks import tolerances_by_dtype
from infer.models.gemma3_vision import ImagePreprocessing, VisionConfig, load_gemma3_vision

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_gemma3_vision(tmp_path_factory):
    config = transformers.Gemma3Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=300,
            max_position_embeddings=256,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=4,
            layer_norm_eps=1e-6,
        ),
        mm_tokens_per_image=16,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # the projector's weights start at zero
            parameter.copy_(torch.randn_like(parameter) * 0.2)
    folder = tmp_path_factory.mktemp("gemma3-vision")
    model.save_pretrained(folder)
    return folder, model


def test_the_vision_tower_gives_transformers_image_features(tiny_gemma3_vision):
    folder, reference = tiny_gemma3_vision
    ours = load_gemma3_vision(folder)
    assert VisionConfig.from_file(folder).mm_tokens_per_image == 16
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.model.get_image_features(pixels).pooler_output
    got = ours(pixels)
    assert got.shape == expected.shape == (3, 16, 64)
    max_abs = (got - expected).abs().max().item()
    # The same operations in fp32, in another order: 6e-7 here. The parity bound for logits
    # (1e-3) would let a wrong GELU through (the exact one instead of the tanh one: 1.6e-4).
    assert max_abs <= min(1e-5, tolerances_by_dtype()["float32"]["max_abs"]), max_abs
    assert expected.abs().mean() > 0.1  # a real signal, not zeros


def test_a_text_only_checkpoint_has_no_vision_tower(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text", "hidden_size": 64}')
    with pytest.raises(ValueError, match="no vision_config"):
        load_gemma3_vision(tmp_path)


def test_the_release_checkpoints_names_load_the_same_tower(tiny_gemma3_vision, tmp_path):
    """Google's Gemma 3 releases keep the tower under vision_tower.vision_model. (transformers
    5 writes vision_tower.): the same tensors under those names give the same features."""
    folder, _ = tiny_gemma3_vision
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    renamed = {
        name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if name.startswith("vision_tower.")
        else name: tensor
        for name, tensor in tensors.items()
    }
    assert any(name.startswith("vision_tower.vision_model.") for name in renamed)
    safetensors.torch.save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(load_gemma3_vision(tmp_path)(pixels), load_gemma3_vision(folder)(pixels))


def test_images_are_preprocessed_as_transformers_gemma3_processor_does(tiny_gemma3_vision):
    """Against Gemma3ImageProcessorPil (pan-and-scan off): images of other sizes and aspect
    ratios, one with an alpha channel, resized to the tower's input and normalized."""
    from PIL import Image

    folder, _ = tiny_gemma3_vision
    preprocess = ImagePreprocessing.from_folder(folder)
    assert preprocess.size == 32
    generator = np.random.default_rng(3)
    images = [
        Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((50, 70), (32, 32), (9, 200))
    ]
    images.append(Image.fromarray(generator.integers(0, 256, (40, 40, 4), dtype=np.uint8), mode="RGBA"))
    reference = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}
    )
    expected = reference(images, return_tensors="pt")["pixel_values"]
    got = preprocess(images)
    assert got.shape == expected.shape == (4, 3, 32, 32)
    assert (got - expected).abs().max().item() <= 1e-6
