"""Tiny random checkpoints for the in-process benchmarks, made once per session."""

import pytest
import torch

from infer.models.random_checkpoint import make_random_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {
        preset: make_random_checkpoint(preset, root / preset, dtype=torch.float32)
        for preset in ("llama-tiny", "qwen3-tiny")
    }
