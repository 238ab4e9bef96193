"""Gemma 3's vision tower (infer.models.gemma3_vision) beyond its parity with transformers, which
specs/vlm checks (VLM-001, VLM-002): the release checkpoints' tensor names load the same tower,
and a text-only checkpoint says it has none."""

import shutil

import pytest
import safetensors.torch
import torch

from conformance.vlm.checkpoints import IMAGE_SIZE, tiny_gemma3_vision
from infer.models.gemma3_vision import VisionConfig, load_gemma3_vision


def test_the_release_checkpoints_names_load_the_same_tower(tmp_path):
    """Google's Gemma 3 releases keep the tower under vision_tower.vision_model. (transformers
    5 writes vision_tower.): the same tensors under those names give the same features."""
    folder, _ = tiny_gemma3_vision()
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
    pixels = torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2))
    assert torch.equal(load_gemma3_vision(tmp_path)(pixels), load_gemma3_vision(folder)(pixels))
    assert VisionConfig.from_file(folder).mm_tokens_per_image == 16


def test_a_text_only_checkpoint_has_no_vision_tower(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text", "hidden_size": 64}')
    with pytest.raises(ValueError, match="no vision_config"):
        load_gemma3_vision(tmp_path)
