"""CUDA graphs for whole steps: a step's tokens in, its sampling rows' logits out.

A step of a small model is mostly CPU time when run eagerly: hundreds of kernel launches of tens
of microseconds each. On an H100 with Llama 3.2 1B shapes, an eager forward of 64 decode rows and
a 512-token prompt chunk took 13.9 ms to launch for 3.7 ms of GPU work. A graph replays all the
launches at once. Graphs need static shapes and addresses, so the inputs live in static device
buffers, and a step is copied into the smallest captured shape that holds it:

- **Decode-only steps**: one graph per batch bucket (powers of two up to max_batch_size). A step
  of B rows replays the smallest bucket >= B.
- **Mixed steps** (prompt chunks, with or without decode rows), when `mixed_steps`: one graph per
  bucket of decode rows (every other power of two down from max_batch_size, none below
  MIN_MIXED_DECODE_BUCKET) and bucket of chunk tokens (powers of two from MIN_CHUNK_BUCKET up to
  max_num_batched_tokens). Its first rows and tokens are the decode bucket's decode rows, then
  come up to MAX_GRAPH_CHUNK_ROWS chunk rows whose tokens fill the chunk bucket. The extend
  kernel launches from a tile map (paged_attention's `extend_tiles`), so one graph serves any
  split of its bucket's tokens between rows. A step with more chunk rows, or more chunk tokens
  than the largest bucket, runs eagerly.

Padding: decode rows past the step's are token 0 at position 0, writing their K/V to the pool's
reserved null block (never lent to a request) and reading one key from it; chunk rows past the
step's have no tokens and no tiles; tokens past the step's are such pad tokens too. Attention
reads each row's keys through its block table with lengths on the device, and its decode launch
is sized for `max_seq_len`, so one graph serves every context length.

Async scheduling: a decode row's input may be a placeholder for a token the previous step
sampled on the device (see runner.py); with `last_sampled` given, every graph first resolves the
placeholders from it.

The host fills its pinned input buffers for a step only once the previous step's copies out of
them have run (an event): a step that samples nothing, or async scheduling, leaves them queued.

Sampling stays outside the graph (per-request generators, data-dependent paths).
"""

import collections
from collections.abc import Callable, Sequence

import numpy as np
import torch

from infer.engine.input_batch import StepInputs, resolve_pending_tokens
from infer.kernels import extend_tile_size
from infer.models.forward_batch import AttentionMetadata, ForwardBatch

# Chunk rows a mixed-step graph holds. A serving step rarely holds more than a few prompt
# chunks; one with more runs eagerly. Each slot costs empty programs of the extend kernel.
MAX_GRAPH_CHUNK_ROWS = 16
# The smallest chunk-token bucket of the mixed-step graphs.
MIN_CHUNK_BUCKET = 16
# The mixed-step graphs' decode rows come in every other power of two (each pad row costs a
# token of every GEMM), none below this: a step of 40 decode rows and a 512-token chunk pads to
# 64 rows, not to max_batch_size (256 by default on CUDA, which cost W2 at 64 about 6% of its
# output rate on an H200: docs/benchmarks/serving.md#defaults).
MIN_MIXED_DECODE_BUCKET = 16


def batch_buckets(largest: int) -> list[int]:
    """Powers of two below `largest`, then `largest` itself."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return [*sizes, largest]


def mixed_decode_buckets(max_batch_size: int) -> list[int]:
    """The mixed-step graphs' decode-row buckets: every other batch bucket down from the largest,
    none below MIN_MIXED_DECODE_BUCKET (the largest alone where all are)."""
    buckets = batch_buckets(max_batch_size)[::-2][::-1]
    return [size for size in buckets if size >= MIN_MIXED_DECODE_BUCKET] or buckets[-1:]


def chunk_buckets(max_num_batched_tokens: int) -> list[int]:
    """The mixed-step graphs' chunk-token buckets: batch_buckets from MIN_CHUNK_BUCKET on."""
    buckets = batch_buckets(max_num_batched_tokens)
    return [size for size in buckets if size >= MIN_CHUNK_BUCKET] or buckets[-1:]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StepGraphs:
    """`logits(step)`: what `model.compute_logits` of the eager forward gives for the step's
    sampling rows, in order; None when no captured graph holds the step."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        kv_scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        max_batch_size: int,
        max_seq_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        null_block: int,
        mixed_steps: bool = True,
        last_sampled: torch.Tensor | None = None,
    ):
        """`model`: built with its kernel policy (infer.models.kernel_policy), whose launch
        options each captured kernel keeps (programmatic dependent launch in the batch-1 decode
        graph, with KernelPolicy.use_pdl). `last_sampled`: the runner's device copy of the
        previous step's sampled tokens, which placeholder input ids point into (runner.py)."""
        self.model = model
        self.last_sampled = last_sampled
        self.kv_layers = kv_layers
        self.kv_scales = kv_scales
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.null_block = null_block
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        self.decode_buckets = batch_buckets(max_batch_size)
        self.chunk_buckets = chunk_buckets(max_num_batched_tokens) if mixed_steps else []
        self.mixed_decode_buckets = mixed_decode_buckets(max_batch_size) if mixed_steps else []
        self.tile_size = extend_tile_size(model.config.head_dim)
        rows = max_batch_size
        chunk_rows = MAX_GRAPH_CHUNK_ROWS if mixed_steps else 0
        max_chunk_tokens = self.chunk_buckets[-1] if mixed_steps else 0
        self.max_rows = rows + chunk_rows
        self.max_tokens = rows + max_chunk_tokens
        self.max_blocks = _cdiv(max_seq_len, block_size)
        max_tiles = _cdiv(max_chunk_tokens, self.tile_size) + chunk_rows

        # The graphs' inputs live in two device buffers with a pinned host twin each, so that a
        # step fills numpy views of the host side and sends each with one asynchronous copy.
        # int64: token ids, positions, cache slots (max_tokens each), then logits indices
        # (max_rows). int32: lengths (max_rows), query starts (max_rows + 1), the tile map
        # (2 x max_tiles), then the block table (max_rows x max_blocks) whose first rows are
        # contiguous, so that a step sends only the rows it uses.
        tokens, num_rows = self.max_tokens, self.max_rows
        self._host_long = torch.zeros(3 * tokens + num_rows, dtype=torch.long, pin_memory=True)
        self._table_start = 2 * num_rows + 1 + 2 * max_tiles
        num_ints = self._table_start + num_rows * self.max_blocks
        self._host_int = torch.zeros(num_ints, dtype=torch.int32, pin_memory=True)
        self._long = self._host_long.to(self.device)
        self._int = self._host_int.to(self.device)
        host_long, host_int = self._host_long.numpy(), self._host_int.numpy()
        self._host_inputs = host_long[: 3 * tokens].reshape(3, tokens)  # ids, positions, slots
        self._host_logits_indices = host_long[3 * tokens :]
        self._host_seq_lens = host_int[:num_rows]
        self._host_query_start_loc = host_int[num_rows : 2 * num_rows + 1]
        self._host_tiles = host_int[2 * num_rows + 1 : self._table_start]
        self._host_block_tables = host_int[self._table_start :].reshape(num_rows, self.max_blocks)
        self.input_ids, self.positions, self.slot_mapping = self._long[: 3 * tokens].view(3, tokens)
        self.logits_indices = self._long[3 * tokens :]
        self.seq_lens = self._int[:num_rows]
        self.query_start_loc = self._int[num_rows : 2 * num_rows + 1]
        self._tiles = self._int[2 * num_rows + 1 : self._table_start]
        self.block_tables = self._int[self._table_start :].view(num_rows, self.max_blocks)
        # Decode rows come first, one token each: query start i is i up to a graph's decode rows,
        # and a mixed step writes its chunk rows' starts after them (`_set_query_starts`).
        self._host_query_start_loc[: rows + 1] = np.arange(rows + 1)

        self._decode_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # By (decode rows, chunk tokens).
        self._mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits here: one buffer for all of them, not one each (a graph's
        # own would be [rows, vocab] float32, 125 MiB at 256 rows of a 128k vocabulary).
        self._logits: torch.Tensor | None = None
        # Recorded after the latest copies out of the pinned input buffers.
        self._inputs_sent: torch.cuda.Event | None = None
        # One memory pool for every graph: only one runs at a time and its logits are consumed
        # before the next replay.
        self._pool = torch.cuda.graph_pool_handle()
        # Steps replayed so far, by kind of graph.
        self.num_replays = {"decode": 0, "mixed": 0}
        # Mixed steps replayed so far, by the decode rows of their graph.
        self.mixed_replays_by_decode_rows: collections.Counter[int] = collections.Counter()

    @property
    def max_batch_size(self) -> int:
        return self.decode_buckets[-1]

    @property
    def num_captured(self) -> int:
        return len(self._decode_graphs) + len(self._mixed_graphs)

    def capture_all(self) -> None:
        """Captures every bucket now (at start-up), so that no request pays for a capture."""
        for batch_size in self.decode_buckets:
            if batch_size not in self._decode_graphs:
                self._decode_graphs[batch_size] = self._capture_decode(batch_size)
        for decode_rows in self.mixed_decode_buckets:
            for num_chunk_tokens in self.chunk_buckets:
                if (decode_rows, num_chunk_tokens) not in self._mixed_graphs:
                    key = (decode_rows, num_chunk_tokens)
                    self._mixed_graphs[key] = self._capture_mixed(decode_rows, num_chunk_tokens)

    @torch.inference_mode()
    def logits(self, step: StepInputs) -> torch.Tensor | None:
        """[len(step.sampling_rows), vocab] float32 logits, valid until the next call; None when
        the step fits no graph (the caller runs it eagerly)."""
        num_rows = len(step.request_ids)
        if step.num_decode_rows == num_rows:
            if num_rows > self.max_batch_size:
                return None
            logits = self._replay_decode(step)
            if len(step.sampling_rows) == num_rows:
                return logits
            return logits[torch.tensor(step.sampling_rows, device=self.device)]
        num_chunk_rows = num_rows - step.num_decode_rows
        num_chunk_tokens = len(step.input_ids) - step.num_decode_rows
        if (
            not self.chunk_buckets
            or num_chunk_rows > MAX_GRAPH_CHUNK_ROWS
            or num_chunk_tokens > self.chunk_buckets[-1]
            or step.num_decode_rows > self.max_batch_size
        ):
            return None
        return self._replay_mixed(step, num_chunk_tokens)

    # -- decode-only steps --------------------------------------------------------------------

    def _replay_decode(self, step: StepInputs) -> torch.Tensor:
        num_rows = len(step.request_ids)
        batch_size = next(bucket for bucket in self.decode_buckets if bucket >= num_rows)
        if batch_size not in self._decode_graphs:
            self._decode_graphs[batch_size] = self._capture_decode(batch_size)
        graph, logits = self._decode_graphs[batch_size]
        self._wait_inputs_sent()
        inputs = self._host_inputs
        inputs[0, :num_rows] = step.input_ids
        inputs[1, :num_rows] = step.positions
        inputs[2, :num_rows] = step.slot_mapping
        self._set_query_starts(batch_size)  # a mixed step may have written chunk starts there
        self._host_seq_lens[:num_rows] = step.seq_lens
        self._host_block_tables[:num_rows, : step.block_tables.shape[1]] = step.block_tables
        self._set_pad_decode_rows(num_rows, batch_size)
        self._send(batch_size)
        graph.replay()
        self.num_replays["decode"] += 1
        return logits[:num_rows]

    def _capture_decode(self, batch_size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a decode-only step of batch_size rows, and the logits tensor it fills."""
        batch = self._decode_batch(batch_size)
        logits = self._logits_buffer()[:batch_size]

        def forward() -> torch.Tensor:
            self._resolve_pending(batch)
            return self.model.compute_logits(self.model(batch), out=logits)

        return self._capture(forward)

    def _decode_batch(self, batch_size: int) -> ForwardBatch:
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
            kv_scales=self.kv_scales,
        )

    # -- mixed steps ---------------------------------------------------------------------------

    def _replay_mixed(self, step: StepInputs, num_chunk_tokens: int) -> torch.Tensor:
        bucket = next(size for size in self.chunk_buckets if size >= num_chunk_tokens)
        num_decode = step.num_decode_rows
        # The graph's decode rows; its chunk rows start here.
        rows = next(size for size in self.mixed_decode_buckets if size >= num_decode)
        if (rows, bucket) not in self._mixed_graphs:
            self._mixed_graphs[rows, bucket] = self._capture_mixed(rows, bucket)
        num_chunk_rows = len(step.request_ids) - num_decode
        num_tokens = rows + bucket
        self._wait_inputs_sent()
        # Tokens: the step's decode tokens, pad decode tokens up to `rows`, the chunk tokens,
        # then pad tokens up to the bucket.
        inputs = self._host_inputs
        for target, source in zip(inputs, (step.input_ids, step.positions, step.slot_mapping), strict=True):
            target[:num_decode] = source[:num_decode]
            target[rows : rows + num_chunk_tokens] = source[num_decode:]
        self._set_pad_tokens(num_decode, rows)
        self._set_pad_tokens(rows + num_chunk_tokens, num_tokens)
        # Rows: the step's decode rows, pad decode rows, the chunk rows, empty chunk rows.
        seq_lens, block_tables = self._host_seq_lens, self._host_block_tables
        width = step.block_tables.shape[1]
        seq_lens[:num_decode] = step.seq_lens[:num_decode]
        block_tables[:num_decode, :width] = step.block_tables[:num_decode]
        self._set_pad_decode_rows(num_decode, rows)
        seq_lens[rows : rows + num_chunk_rows] = step.seq_lens[num_decode:]
        block_tables[rows : rows + num_chunk_rows, :width] = step.block_tables[num_decode:]
        seq_lens[rows + num_chunk_rows : rows + MAX_GRAPH_CHUNK_ROWS] = 0
        chunk_starts = step.query_start_loc[num_decode:] - num_decode + rows  # [chunk rows + 1]
        self._set_query_starts(rows)
        self._host_query_start_loc[rows : rows + num_chunk_rows + 1] = chunk_starts
        self._host_query_start_loc[rows + num_chunk_rows + 1 : rows + MAX_GRAPH_CHUNK_ROWS + 1] = (
            chunk_starts[-1]
        )
        # The extend kernel's launch plan: every tile of every chunk row, then empty slots.
        tile_counts = _cdiv(np.diff(chunk_starts), self.tile_size)
        num_tiles = int(tile_counts.sum())
        slots = self._num_tile_slots(bucket)
        tile_rows, tile_ids = self._host_tiles[: 2 * slots].reshape(2, slots)
        tile_rows[:num_tiles] = np.repeat(np.arange(rows, rows + num_chunk_rows), tile_counts)
        tile_rows[num_tiles:] = -1
        first_tiles = np.repeat(np.cumsum(tile_counts) - tile_counts, tile_counts)
        tile_ids[:num_tiles] = np.arange(num_tiles) - first_tiles
        tile_ids[num_tiles:] = 0
        # Logits of the sampling rows: their last tokens, at their places in the graph's layout.
        sampled = step.logits_indices
        num_sampled = len(sampled)
        self._host_logits_indices[:num_sampled] = np.where(
            sampled < num_decode, sampled, sampled - num_decode + rows
        )
        self._host_logits_indices[num_sampled:] = 0
        self._send(rows + num_chunk_rows)
        self._mixed_graphs[rows, bucket].replay()
        self.num_replays["mixed"] += 1
        self.mixed_replays_by_decode_rows[rows] += 1
        return self._logits[:num_sampled]

    def _num_tile_slots(self, num_chunk_tokens: int) -> int:
        # Each chunk row adds at most one partly filled tile to the bucket's full ones.
        return _cdiv(num_chunk_tokens, self.tile_size) + MAX_GRAPH_CHUNK_ROWS

    def _mixed_batch(self, rows: int, num_chunk_tokens: int) -> ForwardBatch:
        """The batch of a mixed step of `rows` decode rows and a bucket of chunk tokens."""
        num_rows = rows + MAX_GRAPH_CHUNK_ROWS
        num_tokens = rows + num_chunk_tokens
        slots = self._num_tile_slots(num_chunk_tokens)
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_rows + 1],
            seq_lens=self.seq_lens[:num_rows],
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_rows],
            num_decode_rows=rows,
            max_query_len=num_chunk_tokens,
            max_seq_len=self.max_seq_len,
            extend_tiles=self._tiles[: 2 * slots].view(2, slots),
        )
        return ForwardBatch(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            attention=metadata,
            kv_layers=self.kv_layers,
            kv_scales=self.kv_scales,
            logits_indices=self.logits_indices[:num_rows],
        )

    def _capture_mixed(self, rows: int, num_chunk_tokens: int) -> torch.cuda.CUDAGraph:
        batch = self._mixed_batch(rows, num_chunk_tokens)
        logits = self._logits_buffer()

        def forward() -> None:
            self._resolve_pending(batch)
            hidden = self.model(batch)
            self.model.compute_logits(hidden, out=logits[: hidden.shape[0]])

        graph, _ = self._capture(forward, decode_rows=rows)
        return graph

    # -- shared --------------------------------------------------------------------------------

    def _logits_buffer(self) -> torch.Tensor:
        """[max_rows, vocab] float32: every graph's logits, valid until the next replay."""
        if self._logits is None:
            vocab_size = self.model.config.vocab_size
            self._logits = torch.empty((self.max_rows, vocab_size), dtype=torch.float32, device=self.device)
        return self._logits

    def _set_pad_tokens(self, start: int, stop: int) -> None:
        """Tokens start..stop-1 become pad tokens: id 0 at position 0, written to the null block."""
        self._host_inputs[0, start:stop] = 0
        self._host_inputs[1, start:stop] = 0
        self._host_inputs[2, start:stop] = self.null_block * self.block_size

    def _set_query_starts(self, rows: int) -> None:
        """Query starts 0..rows: one token per decode row."""
        self._host_query_start_loc[: rows + 1] = np.arange(rows + 1)

    def _set_pad_decode_rows(self, start: int, stop: int) -> None:
        """Decode rows start..stop-1 (and their tokens) become padding: one key, in the null block."""
        self._set_pad_tokens(start, stop)
        self._host_seq_lens[start:stop] = 1
        self._host_block_tables[start:stop, 0] = self.null_block

    def _send(self, num_rows: int) -> None:
        """Queues the host buffers' copies to the device, block table rows 0..num_rows-1 only.
        Pinned sources: both copies are queued without waiting; the next step waits for them
        before it writes the host buffers again (`_wait_inputs_sent`)."""
        self._long.copy_(self._host_long, non_blocking=True)
        num_ints = self._table_start + num_rows * self.max_blocks
        self._int[:num_ints].copy_(self._host_int[:num_ints], non_blocking=True)
        if self._inputs_sent is None:
            self._inputs_sent = torch.cuda.Event()
        self._inputs_sent.record()

    def _wait_inputs_sent(self) -> None:
        # Reading a step's sampled tokens waits for its copies, but a step of mid-prompt chunks
        # samples nothing, and async scheduling fills the next step before reading: without
        # this wait a copy still queued would send the next step's inputs (it once gave a
        # request a wrong first token after its prompt chunks).
        if self._inputs_sent is not None:
            self._inputs_sent.synchronize()

    def _resolve_pending(self, batch: ForwardBatch) -> None:
        if self.last_sampled is not None:
            resolve_pending_tokens(batch.input_ids, self.last_sampled)

    def _pad_everything(self, rows: int) -> None:
        """Every row and token a pad (warm-up and capture) for a graph of `rows` decode rows:
        decode rows read the null block, chunk rows have no tokens and no tiles."""
        self._set_query_starts(rows)
        self._set_pad_decode_rows(0, rows)
        self._set_pad_tokens(rows, self.max_tokens)
        self._host_seq_lens[rows:] = 0
        self._host_query_start_loc[rows:] = rows
        self._host_tiles[:] = -1
        self._host_logits_indices[:] = 0
        self._long.copy_(self._host_long)
        self._int.copy_(self._host_int)

    def _capture(
        self, forward: Callable[[], torch.Tensor | None], *, decode_rows: int | None = None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """Captures `forward` after two warm-up runs; returns the graph and what the forward
        returned (tensors it fills on every replay). `decode_rows`: the graph's decode rows
        (None: max_batch_size)."""
        self._pad_everything(self.max_batch_size if decode_rows is None else decode_rows)
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
            output = forward()
        return graph, output
