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

A model that rotates by (t, h, w) positions (Qwen3-VL's M-RoPE) gets them from the tower
(`rope_positions`) for each request with images: its prompt's positions as the tower computes
them, and every later token's position shifted by the prompt's delta. A step's text tokens have
three equal positions, so they rotate by one position each (`StepInputs.positions`, which the
CUDA graphs take as they are); a step with image tokens passes all three
(ForwardBatch.mrope_positions) and runs eagerly, as every step with images does.

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

    embeds: torch.Tensor  # [M, width]: VisionTower.encode's rows
    token_indices: np.ndarray  # [M] int64, into the step's N tokens
    # [N] int32 (models whose images attend both ways), else None.
    lookahead: np.ndarray | None
    # Per request, the images encoded for this step.
    encoded: dict[str, int]
    # The tower's run: CUDA events (start, end), or its seconds on a CPU; None: nothing encoded.
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | float | None
    # [3, N] int64 (t, h, w) positions of the step's tokens, for a model with M-RoPE.
    mrope_positions: np.ndarray | None = None

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
        # M-RoPE: request id -> ([3, prompt length] positions, delta), for requests with images.
        self._rope: dict[str, tuple[np.ndarray, int]] = {}

    def add(self, request_id: str, images: tuple[PromptImage, ...], prompt_ids) -> None:
        """A request the runner takes (new, or resumed after a preemption), and its prompt."""
        self.forget([request_id])
        if images:
            self._images[request_id] = images
            if hasattr(self.tower, "rope_positions"):
                positions, delta = self.tower.rope_positions(
                    list(prompt_ids), [image.pixel_values for image in images]
                )
                self._rope[request_id] = (positions.numpy(), delta)

    def forget(self, request_ids) -> None:
        """Requests that left the runner (finished, failed, preempted)."""
        for request_id in request_ids:
            self._rope.pop(request_id, None)
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

    def rope_positions(self, step: StepInputs) -> tuple[np.ndarray, np.ndarray] | None:
        """For a model with M-RoPE, the step's tokens' (t, h, w) positions `[3, N]`, and the one
        position each rotates by where its three are equal (text); None when no row of the step
        has images (every position is then the token's own)."""
        rows = [
            (row, request_id) for row, request_id in enumerate(step.request_ids) if request_id in self._rope
        ]
        if not rows:
            return None
        triples = np.broadcast_to(step.positions, (3, len(step.positions))).copy()
        for row, request_id in rows:
            prompt, delta = self._rope[request_id]
            first, last = int(step.query_start_loc[row]), int(step.query_start_loc[row + 1])
            positions = step.positions[first:last]
            in_prompt = positions < prompt.shape[1]
            triples[:, first:last] = np.where(
                in_prompt, prompt[:, np.minimum(positions, prompt.shape[1] - 1)], positions + delta
            )
        return triples[0].copy(), triples

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
