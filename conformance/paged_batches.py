"""Paged batches built by hand from forward_batch.py's layout rules, for oracle tests of the
models' addressing (infer-models' test_greedy.py, the parity suite's mixed-step clause): not by
the engine, so what they check is the models against the documented contract.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from infer.cache import KVCacheShape, PagedKVPool
from infer.models.forward_batch import AttentionMetadata, ForwardBatch


class PagedRow(NamedTuple):
    """One row of a cached step: its blocks in order, how many of its tokens are already in the
    cache, and this step's tokens (which follow those)."""

    block_ids: Sequence[int]
    num_cached: int
    new_ids: Sequence[int]


def paged_batch(pool: PagedKVPool, rows: Sequence[PagedRow]) -> ForwardBatch:
    """A ForwardBatch over `pool` for `rows` in the order given (one-token rows first, as the
    contract asks; they are the decode rows). Every token's logits are computed."""
    block_size = pool.block_size
    lengths = [len(row.new_ids) for row in rows]
    positions = [range(row.num_cached, row.num_cached + len(row.new_ids)) for row in rows]
    slots = [
        row.block_ids[p // block_size] * block_size + p % block_size
        for row, ps in zip(rows, positions, strict=True)
        for p in ps
    ]
    width = max(len(row.block_ids) for row in rows)
    # Entries past a row's blocks must never be read: the null block holds garbage like the rest.
    block_tables = [list(row.block_ids) + [pool.null_block] * (width - len(row.block_ids)) for row in rows]
    seq_lens = [row.num_cached + n for row, n in zip(rows, lengths, strict=True)]
    num_decode_rows = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    device = pool.kv_layers[0][0].device
    attention = AttentionMetadata(
        query_start_loc=torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(
            0, dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        num_decode_rows=num_decode_rows,
        max_query_len=max(lengths),
        max_seq_len=max(seq_lens),
    )
    return ForwardBatch(
        input_ids=torch.tensor([t for row in rows for t in row.new_ids], dtype=torch.long, device=device),
        positions=torch.tensor([p for ps in positions for p in ps], dtype=torch.long, device=device),
        attention=attention,
        kv_layers=pool.kv_layers,
        kv_scales=pool.kv_scales,
    )


def scrambled_pool(model, block_size: int | str, num_tokens: int, num_sequences: int = 1) -> PagedKVPool:
    """A pool for `num_sequences` sequences of up to `num_tokens` tokens whose allocator hands out
    blocks out of order, between blocks another owner still holds, all filled with what an earlier
    owner left: a row that reads a block or an offset not its own gets wrong logits."""
    config = model.config
    if block_size == "contiguous":
        block_size = num_tokens
    shape = KVCacheShape(
        config.num_layers, model.num_kv_heads, config.head_dim, model.embed_tokens.weight.dtype, block_size
    )
    num_free = num_sequences * shape.blocks_for_tokens(num_tokens)
    pool = PagedKVPool(shape, num_blocks=2 * num_free, device=model.embed_tokens.weight.device)
    generator = torch.Generator().manual_seed(block_size)
    for k_cache, v_cache in pool.kv_layers:
        k_cache.copy_(torch.randn(k_cache.shape, generator=generator) * 10)
        v_cache.copy_(torch.randn(v_cache.shape, generator=generator) * 10)
    earlier = pool.allocator.allocate(pool.num_blocks, "earlier")
    order = torch.randperm(pool.num_blocks, generator=generator).tolist()
    pool.allocator.free([earlier[i] for i in order[:num_free]], "earlier")
    return pool


def grow(pool: PagedKVPool, block_ids: list[int], num_tokens: int, owner: str) -> None:
    """Appends blocks from the allocator until `block_ids` holds `num_tokens` tokens."""
    block_ids += pool.allocator.allocate(pool.shape.blocks_for_tokens(num_tokens) - len(block_ids), owner)


def cached_step_logits(model, sequences, num_cached: Sequence[int], block_size) -> list[torch.Tensor]:
    """Writes the first num_cached[i] tokens of each sequence into one pool (one forward for all
    prefixes), then runs the rest of every sequence in ONE step over it; that step's logits per row.

    With one sequence this is the sequence alone: its own pool, its prefix, then its step."""
    pool = scrambled_pool(model, block_size, max(map(len, sequences)), num_sequences=len(sequences))
    block_ids: list[list[int]] = [[] for _ in sequences]
    prefixes = [i for i, cached in enumerate(num_cached) if cached]
    for i in prefixes:
        grow(pool, block_ids[i], num_cached[i], f"sequence {i}")
    if prefixes:
        model(paged_batch(pool, [PagedRow(block_ids[i], 0, sequences[i][: num_cached[i]]) for i in prefixes]))
    for i, sequence in enumerate(sequences):
        grow(pool, block_ids[i], len(sequence), f"sequence {i}")
    rows = [
        PagedRow(ids, cached, seq[cached:])
        for ids, cached, seq in zip(block_ids, num_cached, sequences, strict=True)
    ]
    batch = paged_batch(pool, rows)
    return batch.rows(model.compute_logits(model(batch)))
