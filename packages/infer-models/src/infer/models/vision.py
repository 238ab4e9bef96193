"""What the rest of the runtime knows of a vision-language model's images, whatever its tower.

Two halves, because they live in two processes:
- the frontend (the server, which decodes and resizes images and tokenizes prompts) holds an
  `ImageProcessor`, made from the checkpoint folder without loading weights
  (infer.models.registry.image_processor_for): it turns a decoded image into the tower's pixel
  values and says how many placeholder tokens the image takes, and its `layout` says how a
  prompt spells an image;
- the engine's model holds the tower as `CausalLM.vision` (a `VisionTower`: pixel values in, one
  embedding per placeholder token out), loaded with the language model (infer.models.load).

A prompt holds each image as a run of `layout.image_token_id` tokens, one per embedding, which the
model replaces with the tower's embeddings (CausalLM.embed). The chat template writes
`layout.marker` where a message has an image; the frontend replaces each marker with
`layout.expansion(num_tokens)`, the text the model's own processor puts there (Gemma 3's
"\\n\\n<start_of_image>" + 256 soft tokens + "<end_of_image>\\n\\n"), before tokenizing, and
`image_runs` then finds each image's tokens.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class ImageLayout:
    """How a model's prompt spells an image."""

    # The placeholder token, repeated once per image embedding.
    image_token_id: int
    image_token: str
    # What the chat template writes for an image part, and the text around the placeholder run
    # that the model's processor puts in its place.
    marker: str
    before: str
    after: str
    # The tokens of one image attend to each other both ways (Gemma 3); else causally.
    bidirectional: bool

    def expansion(self, num_tokens: int) -> str:
        """The prompt text of an image of `num_tokens` embeddings."""
        return self.before + self.image_token * num_tokens + self.after


class ImageProcessor(Protocol):
    """The frontend's half: a decoded image to the tower's input."""

    layout: ImageLayout

    def __call__(self, image) -> tuple[torch.Tensor, int]:
        """(pixel values of one Pillow image, as the tower takes them; its placeholder count)."""
        ...


class VisionTower(Protocol):
    """The engine's half: `CausalLM.vision`. A tower whose model rotates by (t, h, w) positions
    (Qwen3-VL's M-RoPE) also has `rope_positions(prompt_ids, pixel_values) -> ([3, L], delta)`:
    the prompt's positions, and the delta every later token's position is shifted by."""

    layout: ImageLayout

    def encode(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per image, `[num_tokens, width]` rows in the model's dtype: `width` is the language
        model's hidden size (Gemma 3), or a multiple of it where the model takes several
        embeddings per image token (Qwen3-VL: the merger's, then one per DeepStack level).
        `ForwardBatch.image_embeds` carries rows of that width."""
        ...


def image_runs(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of placeholder tokens, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for index, token in enumerate([*token_ids, None]):
        if token == image_token_id and start is None:
            start = index
        elif token != image_token_id and start is not None:
            runs.append((start, index - start))
            start = None
    return runs


def checkpoint_config(folder: str | Path) -> tuple[dict, dict]:
    """(config.json, its `vision_config`) of a multimodal checkpoint; ValueError for a text-only
    one."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    if "vision_config" not in raw:
        raise ValueError(
            f"{folder}: config.json has no vision_config; a text-only checkpoint has no vision tower"
        )
    return raw, raw["vision_config"]


def has_vision_tower(folder: str | Path) -> bool:
    """Whether a checkpoint's config.json describes a vision tower (Hugging Face's multimodal
    configs nest it as `vision_config`)."""
    return "vision_config" in json.loads((Path(folder) / "config.json").read_text())
