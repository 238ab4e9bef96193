"""CUDA graphs for the decode forward: one token per row in, next-token logits out.

A decode step of a small model is mostly CPU time: hundreds of kernel launches of a few
microseconds each (the H100 profile in docs/benchmarks/generation.md: about 90% of the step).
A graph replays all of them with one launch. Graphs need static shapes, so one is captured per
batch bucket (powers of two up to max_batch_size) and replayed for every batch that fits it:

- rows past the real batch are padding: token 0 at position `max_seq_len - 1`, in the slot of
  the first real row, reading one key. By ForwardBatch's padding rule no real query sees a key at
  that position (callers feed positions <= max_seq_len - 2), so the garbage a pad row writes is
  never read;
- attention reads each row's own keys up to its length (`infer.kernels.decode_attention`, lengths
  on the device), so one graph serves every context length.

Graphs are captured on first use, or all at once with `capture_all` (the engine does this at
start-up). The graphs hold the model, the KV tensors and their own static inputs: a new cache needs a new
`DecodeGraphs`. Sampling stays outside the graph (per-request generators, data-dependent paths).
"""

from collections.abc import Sequence

import torch

from infer.models.forward_batch import ForwardBatch


def _buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` below `largest`, then `largest` itself."""
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return [*sizes, largest]


def _bucket(buckets: list[int], size: int) -> int:
    return next(bucket for bucket in buckets if bucket >= size)


class _CapturedDecode:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, logits: torch.Tensor):
        self.graph = graph
        self.inputs = inputs  # [4, batch]: token ids, positions, slot ids, keys to read
        self.logits = logits  # [batch, vocab], rewritten by every replay


class DecodeGraphs:
    """`logits(token_ids, positions, slot_ids)`: what `model.compute_logits(model(batch))` gives for
    one decode token per row, from a replayed CUDA graph."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_seq_len: int,
        max_batch_size: int,
    ):
        self.model = model
        self.kv_layers = kv_layers
        self.max_seq_len = max_seq_len
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        self.batch_buckets = _buckets(1, max_batch_size)
        self._graphs: dict[int, _CapturedDecode] = {}
        # One memory pool for every graph: only one runs at a time and its logits are consumed
        # before the next replay.
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def capture_all(self) -> None:
        """Captures every batch bucket now, so that no request pays for a capture."""
        for batch_size in self.batch_buckets:
            if batch_size not in self._graphs:
                self._graphs[batch_size] = self._capture(batch_size)

    @torch.inference_mode()
    def logits(
        self, token_ids: Sequence[int], positions: Sequence[int], slot_ids: Sequence[int]
    ) -> torch.Tensor:
        """[len(token_ids), vocab] logits; the view is valid until the next call."""
        num_rows = len(token_ids)
        if not num_rows or not len(positions) == len(slot_ids) == num_rows:
            raise ValueError(
                f"one position and slot per token: {num_rows} tokens, {len(positions)} positions, "
                f"{len(slot_ids)} slots"
            )
        if num_rows > self.batch_buckets[-1]:
            raise ValueError(f"{num_rows} rows, but graphs were sized for at most {self.batch_buckets[-1]}")
        if max(positions) > self.max_seq_len - 2:
            raise ValueError(
                f"position {max(positions)} is past max_seq_len - 2 = {self.max_seq_len - 2}, "
                "where pad rows write"
            )
        batch_size = _bucket(self.batch_buckets, num_rows)
        captured = self._graphs.get(batch_size)
        if captured is None:
            captured = self._graphs[batch_size] = self._capture(batch_size)
        pad = batch_size - num_rows
        host = torch.tensor(
            [
                [*token_ids, *[0] * pad],
                [*positions, *[self.max_seq_len - 1] * pad],
                [*slot_ids, *[slot_ids[0]] * pad],
                [*(position + 1 for position in positions), *[1] * pad],
            ],
            dtype=torch.long,
        )
        captured.inputs.copy_(host, non_blocking=True)
        captured.graph.replay()
        return captured.logits[:num_rows]

    def _capture(self, batch_size: int) -> _CapturedDecode:
        inputs = torch.zeros(4, batch_size, dtype=torch.long, device=self.device)
        # Every row a pad row while warming up and capturing.
        inputs[1] = self.max_seq_len - 1
        inputs[3] = 1

        def forward() -> torch.Tensor:
            batch = ForwardBatch(
                input_ids=inputs[0, :, None],
                positions=inputs[1, :, None],
                kv_layers=self.kv_layers,
                slot_ids=inputs[2],
                seq_lens=inputs[3],
            )
            return self.model.compute_logits(self.model(batch)[:, 0])

        # Warm-up on a side stream, as torch.cuda.graphs asks: compiles Triton kernels and lets
        # the allocator settle before capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        return _CapturedDecode(graph, inputs, logits)
