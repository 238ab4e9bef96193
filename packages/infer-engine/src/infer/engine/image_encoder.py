"""The runner's images: the vision tower run when a step first needs an image, and each step's
image inputs (embeddings at their tokens, and how far each image token sees).

The runner holds every running request's images (from its NewRequest). A step computes some
tokens of each row; where they include an image's tokens, that image's embeddings must be known.
Every image the step needs and has not been encoded yet is encoded first, all in one call of the
tower (`VisionTower.encode`: batched across requests), before the language model's forward; the
embeddings are kept until a step has computed the image's last token (a model whose images attend
one way may take an image in several chunks), then dropped: the KV cache holds what they gave. So
an image whose tokens all came from the prefix cache is never encoded, and a preempted request,
which recomputes, encodes its images again.

The tower's time is measured on the device (CUDA events, read once the step's tokens are) and
shared equally among the step's images.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.images import PromptImage
from infer.engine.input_batch import StepInputs


@dataclass
class StepImages:
    """One step's image inputs (ForwardBatch.image_embeds, image_token_indices, and
    AttentionMetadata.lookahead), and what the tower encoded for it."""

    embeds: torch.Tensor  # [M, hidden]
    token_indices: np.ndarray  # [M] int64, into the step's N tokens
    # [N] int32 (models whose images attend both ways), else None.
    lookahead: np.ndarray | None
    # Per request, the images encoded for this step.
    encoded: dict[str, int]
    # The tower's run: CUDA events (start, end), or its seconds on a CPU; None: nothing encoded.
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | float | None

    def encoded_seconds(self) -> dict[str, tuple[int, float]]:
        """RunnerOutput.images_encoded: per request, (images, seconds); read after the step's
        tokens (its events are done by then)."""
        if self.timing is None:
            return {}
        if isinstance(self.timing, tuple):
            start, end = self.timing
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            seconds = self.timing
        per_image = seconds / sum(self.encoded.values())
        return {request_id: (count, count * per_image) for request_id, count in self.encoded.items()}


class ImageEncoder:
    def __init__(self, tower, *, bidirectional: bool):
        """`tower`: the model's VisionTower (infer.models.vision)."""
        self.tower = tower
        self.bidirectional = bidirectional
        self._images: dict[str, tuple[PromptImage, ...]] = {}
        # (request id, image index) -> [num_tokens, hidden], until its last token is computed.
        self._embeds: dict[tuple[str, int], torch.Tensor] = {}

    def add(self, request_id: str, images: tuple[PromptImage, ...]) -> None:
        """A request the runner takes (new, or resumed after a preemption)."""
        self.forget([request_id])
        if images:
            self._images[request_id] = images

    def forget(self, request_ids) -> None:
        """Requests that left the runner (finished, failed, preempted)."""
        for request_id in request_ids:
            for index in range(len(self._images.pop(request_id, ()))):
                self._embeds.pop((request_id, index), None)

    def step_images(self, step: StepInputs) -> StepImages | None:
        """The step's image inputs, encoding the images it needs first; None when it computes no
        image token."""
        # (request, its row's first token in the flat batch, the row's positions [start, end),
        # image index, image)
        needed: list[tuple[str, int, int, int, int, PromptImage]] = []
        for row, request_id in enumerate(step.request_ids):
            images = self._images.get(request_id)
            if not images:
                continue
            first = int(step.query_start_loc[row])
            start = int(step.positions[first])
            end = start + int(step.query_start_loc[row + 1]) - first
            for index, image in enumerate(images):
                if image.offset < end and start < image.end:
                    needed.append((request_id, first, start, end, index, image))
        if not needed:
            return None
        missing = [
            (rid, index, image) for rid, *_, index, image in needed if (rid, index) not in self._embeds
        ]
        encoded: dict[str, int] = {}
        timing = None
        if missing:
            timing = self._encode(missing)
            for request_id, _, _ in missing:
                encoded[request_id] = encoded.get(request_id, 0) + 1
        pieces, indices = [], []
        lookahead = np.zeros(len(step.input_ids), dtype=np.int32) if self.bidirectional else None
        for request_id, first, start, end, index, image in needed:
            lo, hi = max(image.offset, start), min(image.end, end)
            pieces.append(self._embeds[(request_id, index)][lo - image.offset : hi - image.offset])
            flat = np.arange(first + lo - start, first + hi - start, dtype=np.int64)
            indices.append(flat)
            if lookahead is not None:
                lookahead[flat] = image.end - 1 - np.arange(lo, hi)
            if hi == image.end:  # its last token is computed in this step: the cache holds it now
                del self._embeds[(request_id, index)]
        return StepImages(torch.cat(pieces), np.concatenate(indices), lookahead, encoded, timing)

    def _encode(self, images: list[tuple[str, int, PromptImage]]):
        """Encodes `images` in one call of the tower and keeps their embeddings; the timing."""
        cuda = next(self.tower.parameters()).device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            started = time.perf_counter()
        embeds = self.tower.encode([image.pixel_values for _, _, image in images])
        for (request_id, index, image), embed in zip(images, embeds, strict=True):
            if embed.shape[0] != image.num_tokens:
                raise ValueError(
                    f"image {index} of {request_id!r} has {image.num_tokens} tokens in the prompt, "
                    f"the vision tower gave {embed.shape[0]} embeddings"
                )
            self._embeds[(request_id, index)] = embed
        if cuda:
            end.record()
            return start, end
        return time.perf_counter() - started
