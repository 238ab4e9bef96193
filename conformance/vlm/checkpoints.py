"""A tiny random Gemma 3 multimodal checkpoint that transformers itself writes, once per session:
the reference model for the vision clauses and tests, with every weight random (transformers
starts the projector at zero, which would hide it)."""

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

IMAGE_SIZE = 32  # the tower's input: 8 x 8 patches of 4, pooled to 4 x 4 image tokens
TOKENS_PER_IMAGE = 16
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = 5, 6, 7


@functools.cache
def tiny_gemma3_vision() -> tuple[Path, "torch.nn.Module"]:
    """(checkpoint folder, transformers' Gemma3ForConditionalGeneration over it, eval mode)."""
    import transformers

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
            image_size=IMAGE_SIZE,
            patch_size=4,
            layer_norm_eps=1e-6,
        ),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        # Inside the tiny vocabulary (a release's image token, 262144, lies past its table).
        image_token_index=IMAGE_TOKEN,
        boi_token_index=BOI_TOKEN,
        eoi_token_index=EOI_TOKEN,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)
    folder = Path(tempfile.mkdtemp(prefix="gemma3-vision-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.save_pretrained(folder)
    # A byte-level tokenizer of the vocabulary's size, so that infer.models.load_model and the
    # engine take the folder (its prompts are token ids; what the ids spell does not matter).
    from infer.models.random_checkpoint import _special_tokens, _write_tokenizer

    _write_tokenizer(folder, "gemma3", 300, _special_tokens("gemma3", 300))
    return folder, model
