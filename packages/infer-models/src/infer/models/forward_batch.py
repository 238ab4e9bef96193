"""The one argument of a model forward: a flat batch of tokens and where their KV cache lives.

Built by whoever drives the model (the engine's runner, a test) and passed explicitly; the models
never import a cache package and there is no global attention context.

A step's tokens lie back to back, `[num_tokens]`, row after row (a row is one request's tokens
this step: a prompt chunk, or one decode token). Row b's tokens are
`query_start_loc[b]:query_start_loc[b + 1]`, and they are the last tokens of its sequence: after
the step the row has `seq_lens[b]` keys, so its i-th token sits at position
`seq_lens[b] - query_len_b + i` and sees keys `0..that position` (causal), within the layer's
sliding window if it has one. Rows of one token (decodes) come first.

KV layout (every pool, paged or contiguous): per layer `(k_cache, v_cache)`, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token t of row b lives in block
`block_tables[b, t // block_size]` at offset `t % block_size`; a token's flat slot is
`block * block_size + offset`, and `slot_mapping` names the slot of each new token.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the runner; every layer reads the same one."""

    # [B + 1] int32: cumulative token counts, row b's tokens are [query_start_loc[b], query_start_loc[b+1]).
    query_start_loc: torch.Tensor
    # [B] int32: keys of row b once this step's tokens are written (cached prefix + this step's).
    seq_lens: torch.Tensor
    # [N] int64: flat cache slot of each new token (None without a cache).
    slot_mapping: torch.Tensor | None
    # [B, max_blocks] int32: the blocks of each row in order (None without a cache).
    block_tables: torch.Tensor | None
    # Rows 0..num_decode_rows-1 have exactly one token.
    num_decode_rows: int
    # The longest row's token count and key count this step (host ints: kernel launch sizes).
    max_query_len: int
    max_seq_len: int
    # [2, S] int32, CUDA graphs only: the extend rows' launch plan (paged_attention's
    # extend_tiles); None: the kernel sizes its grid from max_query_len.
    extend_tiles: torch.Tensor | None = None
    # CPU only: each decode row's key slots (keys 0..seq_len-1) as int64, or as a `range` where
    # they are consecutive (read as a view, not gathered), made once per step so that the CPU
    # attention path (paged_attention's decode_key_slots) reads them in every layer instead of
    # computing them from the block table; None: it computes them.
    decode_key_slots: tuple[torch.Tensor | range, ...] | None = None
    # [N] int32: keys past its own position that each token also sees (paged_attention's
    # `lookahead`): for an image's tokens in a model whose images attend both ways, up to the
    # image's last token; 0 for every other token. None: all 0 (causal).
    lookahead: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class ForwardBatch:
    # [N] int64 token ids, rows back to back.
    input_ids: torch.Tensor
    # [N] int64 position of each token in its own sequence.
    positions: torch.Tensor
    # Rows, lengths and cache addresses. None: one row holding every token, no cache.
    attention: AttentionMetadata | None = None
    # Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    # None: no cache, each row attends to its own tokens of this batch only.
    kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Per layer (k_scales, v_scales) of float8_e4m3fn caches, uint8 [num_blocks, block_size,
    # num_kv_heads] (infer.kernels.kv_fp8); None for caches of any other dtype.
    kv_scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    # [R] int64 indices into the N tokens whose logits the caller wants (None: all).
    logits_indices: torch.Tensor | None = None
    # Images (vision-language models): `image_embeds` [M, hidden] (the projector's output, not
    # scaled as token embeddings are) take the place of the M tokens at `image_token_indices`
    # [M] (int64, into the N tokens); `image_groups` [N] int64 numbers each image's tokens (-1
    # for every other token): tokens of one image attend to each other both ways (Gemma 3).
    image_embeds: torch.Tensor | None = None
    image_token_indices: torch.Tensor | None = None
    image_groups: torch.Tensor | None = None
    # [3, N] int64: each token's (t, h, w) rotary positions, for a model with multimodal RoPE
    # (Qwen3-VL, infer.models.mrope). None: each token's `positions` on all three axes (plain RoPE).
    # Causal order, the cache and the rows still go by `positions`.
    mrope_positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def from_tokens(
        token_rows: Sequence[Sequence[int]], *, start_positions: Sequence[int] | None = None, device=None
    ) -> "ForwardBatch":
        """A cache-less batch of rows (oracles and tests): each row attends to its own tokens,
        numbered from its start position (default 0)."""
        starts = list(start_positions) if start_positions is not None else [0] * len(token_rows)
        lengths = [len(row) for row in token_rows]
        if not token_rows or min(lengths) < 1:
            raise ValueError(f"every row needs at least one token, got lengths {lengths}")
        ids = torch.tensor([token for row in token_rows for token in row], dtype=torch.long)
        positions = torch.cat(
            [torch.arange(start, start + n) for start, n in zip(starts, lengths, strict=True)]
        )
        query_start_loc = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens = torch.tensor(
            [start + n for start, n in zip(starts, lengths, strict=True)], dtype=torch.int32
        )
        attention = AttentionMetadata(
            query_start_loc=query_start_loc.to(device),
            seq_lens=seq_lens.to(device),
            slot_mapping=None,
            block_tables=None,
            num_decode_rows=0,
            max_query_len=max(lengths),
            max_seq_len=int(seq_lens.max()),
        )
        return ForwardBatch(input_ids=ids.to(device), positions=positions.to(device), attention=attention)

    def rows(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Splits a per-token tensor ([N, ...]) into one tensor per row."""
        if self.attention is None:
            return [values]
        bounds = self.attention.query_start_loc.tolist()
        return [values[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
