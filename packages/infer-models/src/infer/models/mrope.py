"""Multimodal rotary positions (M-RoPE) as Qwen3-VL writes them: per token a (t, h, w) triple.

A text token's three positions are equal, so it rotates as plain RoPE would. An image's tokens
(its grid of merged patches, row by row) sit at (start, start + row, start + column), where
`start` is the position after the text before it; the text after the image resumes at `start +
max(rows, columns)`. A prompt with images thus ends at a position below its length, by its
`rope_delta` (<= 0): a later token's three positions are its index in the sequence plus the
prompt's `rope_delta` (`decode_mrope_positions`), so only a prompt's positions need the grids.

The rotation splits the head_dim // 2 frequencies among the axes, interleaved (Qwen3-VL):
frequency i follows h where i % 3 == 1 and i < 3 * section[1], w where i % 3 == 2 and
i < 3 * section[2], t elsewhere (transformers' Qwen3VLTextRotaryEmbedding). `MRotaryEmbedding`
gathers each token's cos/sin row from the one-position tables that way, once a forward, and hands
the rows to the usual kernels as a table of one row per token.
"""

import weakref
from collections.abc import Sequence

import torch

from infer.models.common import RotaryEmbedding
from infer.models.config import RopeConfig
from infer.models.vision import image_runs


def mrope_positions(
    prompt_ids: Sequence[int],
    image_grids: Sequence[tuple[int, int, int]],
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """([3, len(prompt_ids)] int64 positions, rope_delta) of a prompt, as transformers'
    `Qwen3VLModel.get_rope_index`. `image_grids`: each image's (t, h, w) patch grid (the
    processor's `image_grid_thw`), in prompt order; image i's tokens are the next
    `t * h * w / spatial_merge_size**2` placeholder tokens."""
    merge = spatial_merge_size
    runs = image_runs(list(prompt_ids), image_token_id)
    # Consecutive images with no text between them make one run: split it by the grids.
    spans, grids = [], iter(image_grids)
    for offset, length in runs:
        while length > 0:
            t, h, w = next(grids, (0, 0, 0))
            num_tokens = t * h * w // merge**2
            if num_tokens == 0 or num_tokens > length:
                raise ValueError(
                    f"the image tokens at {offset} do not match the image grids {list(image_grids)}: "
                    f"each image needs t * h * w / {merge}**2 placeholder tokens"
                )
            spans.append((offset, num_tokens, t, h // merge, w // merge))
            offset, length = offset + num_tokens, length - num_tokens
    if len(spans) != len(image_grids):
        raise ValueError(f"{len(image_grids)} image grids for {len(spans)} images in the prompt")
    pieces, position, cursor = [], 0, 0
    for offset, num_tokens, t, rows, columns in spans:
        pieces.append(torch.arange(offset - cursor).expand(3, -1) + position)
        position += offset - cursor
        grid_t, grid_h, grid_w = torch.meshgrid(
            torch.arange(t), torch.arange(rows), torch.arange(columns), indexing="ij"
        )
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + position)
        position += max(rows, columns)
        cursor = offset + num_tokens
    pieces.append(torch.arange(len(prompt_ids) - cursor).expand(3, -1) + position)
    positions = torch.cat(pieces, dim=1)
    rope_delta = int(positions.max()) + 1 - len(prompt_ids) if len(prompt_ids) else 0
    return positions, rope_delta


def decode_mrope_positions(positions: torch.Tensor, rope_delta: int) -> torch.Tensor:
    """[3, N] positions of tokens after a prompt (generated ones) at sequence `positions` [N]:
    each axis at the index plus the prompt's `rope_delta`."""
    return (positions + rope_delta).expand(3, -1)


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding over `[3, N]` (t, h, w) positions (ForwardBatch.mrope_positions); `[N]`
    positions rotate as plain RoPE."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__(head_dim, max_positions, rope)
        if rope.mrope_section is None or len(rope.mrope_section) != 3:
            raise ValueError(f"M-RoPE needs a 3-axis mrope_section, got {rope.mrope_section}")
        # Each frequency's axis (0 t, 1 h, 2 w); a list, as the model may be built on the meta device.
        section = rope.mrope_section
        self.axis = [0] * (head_dim // 2)
        for dim in (1, 2):  # transformers' slice(dim, 3 * section[dim], 3)
            for frequency in range(dim, min(3 * section[dim], head_dim // 2), 3):
                self.axis[frequency] = dim
        # (the forward's mrope positions, by weak reference; its (cos, sin) rows, each
        # [N, head_dim // 2], and the index 0..N-1 that picks them), shared by the layers.
        self._token_rows: tuple[weakref.ref, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def token_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, index) of `[3, N]` positions: each token's cos/sin row `[N, head_dim // 2]`,
        frequency i from the table row at its axis's position, and `arange(N)`."""
        rows = self._token_rows
        if rows is None or rows[0]() is not positions:
            cos, sin = self.tables(positions.device)
            columns = torch.arange(self.head_dim // 2, device=positions.device)
            picked = positions[torch.tensor(self.axis, device=positions.device)].T  # [N, head_dim // 2]
            index = torch.arange(positions.shape[1], device=positions.device)
            rows = self._token_rows = (
                weakref.ref(positions),
                cos[picked, columns],
                sin[picked, columns],
                index,
            )
        return rows[1], rows[2], rows[3]

    def rotation(
        self, positions: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """RotaryEmbedding.rotation; for `[3, N]` positions each token's rows, which the index
        0..N-1 picks (none on a CPU, whose kernel takes rows as they are)."""
        if positions.dim() == 1:
            return super().rotation(positions, device)
        cos, sin, index = self.token_rows(positions)
        return cos, sin, None if device.type == "cpu" else index
