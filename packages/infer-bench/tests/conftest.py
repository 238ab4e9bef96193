"""Tiny random checkpoints for the in-process benchmarks, made once per session."""

import json

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


@pytest.fixture(scope="session")
def vision_engine_config(tmp_path_factory):
    """An EngineConfig file: gemma3-vision-tiny (a 32 x 32 image is 16 tokens) on the CPU with a
    prefix cache, and room for W6's requests."""
    from infer.engine.config import EngineConfig

    # Prompt + output tokens of a W6 request here, whose tokenizer spells words nearly letter by
    # letter: about 130 + 128, more than the preset's 256 positions.
    max_seq_len = 512
    root = tmp_path_factory.mktemp("vision")
    folder = make_random_checkpoint("gemma3-vision-tiny", root / "gemma3-vision-tiny", dtype=torch.float32)
    hf_config = json.loads((folder / "config.json").read_text())
    hf_config["text_config"]["max_position_embeddings"] = max_seq_len
    (folder / "config.json").write_text(json.dumps(hf_config))
    config = EngineConfig(
        model=str(folder), device="cpu", max_batch_size=4, max_seq_len=max_seq_len,
        kv_cache_backend="paged", use_chunked_prefill=True, use_prefix_caching=True,
    )  # fmt: skip
    path = root / "engine.json"
    path.write_text(json.dumps(config.to_dict()))
    return path


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory):
    """The tokenizer of a random llama-3.2-1b checkpoint (no weights): its vocabulary spells each
    of COMMON_WORDS as one token, as real tokenizers do (the tiny presets' spell bytes)."""
    from tokenizers import Tokenizer

    folder = make_random_checkpoint("llama-3.2-1b", tmp_path_factory.mktemp("words") / "ckpt", weights=False)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))
