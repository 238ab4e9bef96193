"""A prompt's images as the engine core sees them: where each one's placeholder tokens lie, the
vision tower's input, and the image's fingerprint, which keys the prefix cache.

The frontend decodes and preprocesses every image (infer.models.vision.ImageProcessor) and sends
them with the request (`EngineRequest.images`); the runner runs the tower when a prompt chunk
first needs an image's embeddings (infer.engine.image_encoder). The prefix cache reads a request's
tokens with each image's placeholders replaced by a token made from its fingerprint
(`cache_key_ids`), as the second design document keys its cache: the same text with a different
image parts from the cached one at that image, the same image matches on through it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptImage:
    # The image's placeholder tokens are prompt tokens [offset, offset + num_tokens).
    offset: int
    num_tokens: int
    # What the tower takes for this image (infer.models.vision.ImageProcessor's output).
    pixel_values: torch.Tensor
    # Hex digest of the image's bytes, or of its base64 text (infer.server.media).
    fingerprint: str

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def cache_token(self) -> int:
        """The image's token in prefix-cache keys: negative, so never a vocabulary id, and 60
        bits of the fingerprint, so two images that differ differ here."""
        return -1 - int(self.fingerprint[:15], 16)


def cache_key_ids(token_ids: list[int], images: Sequence[PromptImage]) -> list[int]:
    """`token_ids` (a new list) with each image's placeholder tokens replaced by its cache token."""
    key = list(token_ids)
    for image in images:
        key[image.offset : image.end] = [image.cache_token] * image.num_tokens
    return key


def check_images(images: Sequence[PromptImage], prompt_ids: Sequence[int], image_token_id: int) -> None:
    """Raises ValueError unless the images lie inside the prompt, in order, each over
    `image_token_id` tokens."""
    previous_end = 0
    for index, image in enumerate(images):
        if not previous_end <= image.offset < image.end <= len(prompt_ids):
            raise ValueError(
                f"image {index}'s tokens [{image.offset}, {image.end}) are not inside the prompt after "
                "the image before it"
            )
        previous_end = image.end
        if any(token != image_token_id for token in prompt_ids[image.offset : image.end]):
            raise ValueError(
                f"image {index}: prompt tokens [{image.offset}, {image.end}) are not all the model's "
                f"image token {image_token_id}"
            )


@dataclass
class ImageCounts:
    """What the vision tower did and what the prefix cache spared it (the scheduler's), the
    figures behind infer_vision_* metrics and /v1/stats."""

    # Images the tower encoded (a preempted request's are encoded again when it recomputes).
    num_encoded: int = 0
    # Images whose every token's K/V came from the prefix cache at admission: never encoded.
    num_skipped: int = 0
    # Image tokens whose K/V came from the prefix cache.
    num_tokens_reused: int = 0
    # Seconds the tower ran (device time on CUDA).
    encoder_s: float = 0.0

    def admitted(self, images: Sequence[PromptImage], num_cached_tokens: int) -> None:
        """A request starts with `num_cached_tokens` of its tokens from the prefix cache."""
        for image in images:
            reused = max(0, min(image.end, num_cached_tokens) - image.offset)
            self.num_tokens_reused += reused
            self.num_skipped += reused == image.num_tokens

    def engine_stats(self) -> dict:
        return dict(
            vision_encoder_runs=self.num_encoded,
            vision_encoder_skipped=self.num_skipped,
            vision_image_tokens_reused=self.num_tokens_reused,
            vision_encoder_time_s=self.encoder_s,
        )
