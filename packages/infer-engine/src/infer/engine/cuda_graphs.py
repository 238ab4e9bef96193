"""CUDA graphs for decode-only steps: one token per row in, next-token logits out.

A decode step of a small model is mostly CPU time: hundreds of kernel launches of a few
microseconds each (the H100 profile in docs/benchmarks/generation.md: about 90% of the step).
A graph replays all of them with one launch. Graphs need static shapes and addresses, so the
inputs live in static device buffers sized for `max_batch_size` rows, one graph is captured per
batch bucket (powers of two up to max_batch_size), and a step of B rows replays the smallest
bucket >= B:

- rows past B are padding: token 0 at position 0, writing its K/V to the pool's reserved null
  block (never lent to a request) and reading one key from it;
- attention reads each row's own keys through its block table, with lengths on the device, and
  its launch is sized for `max_seq_len`, so one graph serves every context length.

Mixed steps (prompt chunks with decodes) run eagerly: their token counts vary too much to bucket.
Sampling stays outside the graph (per-request generators, data-dependent paths).
"""

from collections.abc import Sequence

import numpy as np
import torch

from infer.models.forward_batch import AttentionMetadata, ForwardBatch


def batch_buckets(largest: int) -> list[int]:
    """Powers of two below `largest`, then `largest` itself."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return [*sizes, largest]


class DecodeGraphs:
    """`logits(...)`: what `model.compute_logits(model(batch))` gives for a decode-only step."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch_size: int,
        max_seq_len: int,
        block_size: int,
        null_block: int,
    ):
        self.model = model
        self.kv_layers = kv_layers
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.null_block = null_block
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        self.buckets = batch_buckets(max_batch_size)
        max_blocks = -(-max_seq_len // block_size)
        rows = max_batch_size
        device = self.device
        # The graphs' inputs, in two device buffers with a pinned host twin each, so that a step
        # fills numpy views of the host side and sends each with one asynchronous copy:
        # int64 [3, rows] (token ids, positions, cache slots) and int32 [rows + rows x max_blocks]
        # (lengths, then the block table, whose first B rows are contiguous).
        self._host_tokens = torch.zeros((3, rows), dtype=torch.long, pin_memory=True)
        self._host_tables = torch.zeros(rows * (1 + max_blocks), dtype=torch.int32, pin_memory=True)
        self._tokens = self._host_tokens.to(device)
        self._tables = self._host_tables.to(device)
        self.input_ids, self.positions, self.slot_mapping = self._tokens.unbind(0)
        self.seq_lens = self._tables[:rows]
        self.block_tables = self._tables[rows:].view(rows, max_blocks)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        host_tokens = self._host_tokens.numpy()
        self._host_input_ids, self._host_positions, self._host_slot_mapping = host_tokens
        host_tables = self._host_tables.numpy()
        self._host_seq_lens = host_tables[:rows]
        self._host_block_tables = host_tables[rows:].reshape(rows, max_blocks)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # One memory pool for every graph: only one runs at a time and its logits are consumed
        # before the next replay.
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def capture_all(self) -> None:
        """Captures every bucket now (at start-up), so that no request pays for a capture."""
        for batch_size in self.buckets:
            if batch_size not in self._graphs:
                self._graphs[batch_size] = self._capture(batch_size)

    @torch.inference_mode()
    def logits(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """[B, vocab] logits of B decode rows; the view is valid until the next call."""
        num_rows = len(input_ids)
        if not 0 < num_rows <= self.max_batch_size:
            raise ValueError(f"{num_rows} rows, but graphs were captured for 1..{self.max_batch_size}")
        batch_size = next(bucket for bucket in self.buckets if bucket >= num_rows)
        if batch_size not in self._graphs:
            self._graphs[batch_size] = self._capture(batch_size)
        graph, logits = self._graphs[batch_size]
        self._host_input_ids[:num_rows] = input_ids
        self._host_positions[:num_rows] = positions
        self._host_slot_mapping[:num_rows] = slot_mapping
        self._host_seq_lens[:num_rows] = seq_lens
        self._host_block_tables[:num_rows, : block_tables.shape[1]] = block_tables
        self._set_pad_rows(num_rows, batch_size)
        # Pinned sources: both copies are queued without waiting, and the host buffers are not
        # written again before the step's sampled tokens are read, which waits for the copies.
        self._tokens.copy_(self._host_tokens, non_blocking=True)  # [3, max rows]: a few KiB
        num_table_ints = self.max_batch_size + batch_size * self.block_tables.shape[1]
        self._tables[:num_table_ints].copy_(self._host_tables[:num_table_ints], non_blocking=True)
        graph.replay()
        return logits[:num_rows]

    def _set_pad_rows(self, start: int, stop: int) -> None:
        """Rows start..stop-1 become padding: token 0 at position 0 writing to and reading one key
        of the null block."""
        self._host_input_ids[start:stop] = 0
        self._host_positions[start:stop] = 0
        self._host_slot_mapping[start:stop] = self.null_block * self.block_size
        self._host_seq_lens[start:stop] = 1
        self._host_block_tables[start:stop] = self.null_block

    def _batch(self, batch_size: int) -> ForwardBatch:
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            num_decode_rows=batch_size,
            max_query_len=1,
            # The launch is sized for the longest possible row; shorter rows end early.
            max_seq_len=self.max_seq_len,
        )
        return ForwardBatch(
            input_ids=self.input_ids[:batch_size],
            positions=self.positions[:batch_size],
            attention=metadata,
            kv_layers=self.kv_layers,
        )

    def _capture(self, batch_size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Every row is a pad row while warming up and capturing.
        self._set_pad_rows(0, self.max_batch_size)
        self._tokens.copy_(self._host_tokens)
        self._tables.copy_(self._host_tables)
        batch = self._batch(batch_size)

        def forward() -> torch.Tensor:
            return self.model.compute_logits(self.model(batch))

        # Warm-up on a side stream, as torch.cuda.graphs asks: compiles Triton kernels and lets
        # the allocator settle before capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        return graph, logits
