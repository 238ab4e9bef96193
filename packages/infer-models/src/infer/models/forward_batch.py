"""The one argument of a model forward: token ids, positions and where the KV cache lives.

Built by whoever drives the model (a test, the engine's runner) and passed explicitly; the
models never import a cache package and there is no global attention context.

Padding rule: rows are right-padded to a common length T, and a pad token takes a position past
the row's real tokens (e.g. last real position + 1, + 2, ... clamped to the cache length).
Causal masking by position then keeps every real query away from every pad key, with a cache or
without, so no separate validity mask is needed. Outputs at pad positions are garbage; callers
read only the rows and columns they asked for.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    # [B, T] int64 token ids, right-padded.
    input_ids: torch.Tensor
    # [B, T] int64 position of each token in its own sequence.
    positions: torch.Tensor
    # Per layer (k_cache, v_cache), each [num_slots, num_kv_heads, max_seq_len, head_dim].
    # None: no cache, attention sees only this batch's tokens.
    kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    # [B] int64 cache slot of each row. None: row b uses slot b (a view, no gather).
    slot_ids: torch.Tensor | None = None
    # Keys to read per slot: 1 + the largest position in the batch. None: the whole cache.
    context_len: int | None = None
    # [B] int64, for decode batches (one token per row) on CUDA, where each row reads only its own
    # keys: how many row b reads (0..n-1 of its slot). None: its position + 1. CUDA graphs give
    # their pad rows 1, which would otherwise read a whole slot (they sit at its last position).
    seq_lens: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @staticmethod
    def from_tokens(
        token_rows: Sequence[Sequence[int]], *, start_positions: Sequence[int] | None = None, device=None
    ) -> "ForwardBatch":
        """A cache-less batch of right-padded rows (the plain loop and the tests use this)."""
        width = max(len(row) for row in token_rows)
        starts = start_positions or [0] * len(token_rows)
        ids = torch.zeros(len(token_rows), width, dtype=torch.long)
        for b, row in enumerate(token_rows):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        positions = torch.arange(width).unsqueeze(0) + torch.tensor(starts).unsqueeze(1)
        return ForwardBatch(input_ids=ids.to(device), positions=positions.to(device))
