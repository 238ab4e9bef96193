"""Two ways to get next-token logits for one growing sequence: with a KV cache, or by recomputing.

Both answer `prefill(prompt_ids)` (logits after the last prompt token) and `decode(token_id)`
(logits after appending that token), so the generation loop does not know which it has.
`RecomputeForward` re-runs the whole sequence every step without a cache: the benchmark's
baseline and the oracle the cached path is tested against.
"""

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from infer.cache import ContiguousKVCache, KVCacheShape
from infer.engine.cuda_graphs import DecodeGraphs
from infer.models.forward_batch import ForwardBatch

# The cache grows in steps of this many positions, so requests of similar length reuse it.
_CACHE_LENGTH_STEP = 256


class ForwardPath(Protocol):
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor: ...

    def decode(self, token_id: int) -> torch.Tensor: ...


def model_dtype_and_device(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    parameter = next(model.parameters())
    return parameter.dtype, parameter.device


def _last_logits(model, batch: ForwardBatch) -> torch.Tensor:
    hidden = model(batch)
    # Only the last position's logits are needed: [1, 1, V] instead of [1, T, V].
    return model.compute_logits(hidden[:, -1:, :])[0, -1]


class CachedForward:
    """Prefill in one forward that fills the cache, then one token per forward (gpt-fast style).

    The cache is allocated on the first request and kept; a longer request allocates a longer one.
    Stale entries need no clearing: positions are written in order from 0 and attention reads
    only keys at positions <= the query's. With `cuda_graph=True` each decode replays a CUDA graph
    (infer.engine.cuda_graphs), captured anew whenever the cache is.
    """

    def __init__(self, model: torch.nn.Module, *, cuda_graph: bool = False):
        self.model = model
        self.dtype, self.device = model_dtype_and_device(model)
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {self.device}")
        self.cuda_graph = cuda_graph
        self.cache: ContiguousKVCache | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.num_cached = 0

    def reserve(self, num_positions: int) -> None:
        """Make room for a sequence of `num_positions` tokens (prompt + generated)."""
        if self.cache is not None and self.cache.shape.max_seq_len >= num_positions:
            return
        config = self.model.config
        length = -(-num_positions // _CACHE_LENGTH_STEP) * _CACHE_LENGTH_STEP
        shape = KVCacheShape(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_seq_len=min(length, max(num_positions, config.max_position_embeddings)),
            dtype=self.dtype,
        )
        self.cache = self.decode_graphs = None  # free the old cache before allocating the new one
        # One position beyond the request: the graphs' pad rows write there (none at batch 1, but
        # DecodeGraphs checks every position against it).
        if self.cuda_graph:
            shape = dataclasses.replace(shape, max_seq_len=shape.max_seq_len + 1)
        self.cache = ContiguousKVCache(shape, num_slots=1, device=self.device)
        if self.cuda_graph:
            self.decode_graphs = DecodeGraphs(
                self.model, self.cache.kv_layers, max_seq_len=shape.max_seq_len, max_batch_size=1
            )

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self.reserve(len(prompt_ids))
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)[None]
        self.num_cached = len(prompt_ids)
        return _last_logits(self.model, self._batch(input_ids, positions))

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        position = self.num_cached
        if position >= self.cache.shape.max_seq_len:
            raise ValueError(
                f"the KV cache holds {self.cache.shape.max_seq_len} positions and is full; "
                "call reserve(prompt + max_new_tokens) before prefill"
            )
        self.num_cached += 1
        if self.decode_graphs is not None:
            return self.decode_graphs.logits([token_id], [position], [0])[0]
        input_ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        positions = torch.tensor([[position]], dtype=torch.long, device=self.device)
        return _last_logits(self.model, self._batch(input_ids, positions))

    def _batch(self, input_ids: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            kv_layers=self.cache.kv_layers,
            context_len=self.num_cached,
        )


class RecomputeForward:
    """No cache: every step runs the model over the whole sequence so far."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        _, self.device = model_dtype_and_device(model)
        self.token_ids: list[int] = []

    def reserve(self, num_positions: int) -> None:
        pass

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self.token_ids = list(prompt_ids)
        return self._forward()

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        self.token_ids.append(token_id)
        return self._forward()

    def _forward(self) -> torch.Tensor:
        return _last_logits(self.model, ForwardBatch.from_tokens([self.token_ids], device=self.device))
