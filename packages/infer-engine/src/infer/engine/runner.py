"""ModelRunner: turns a step's prefill chunks and decodes into ForwardBatches, runs the model and
samples each row's next token with the batched sampler.

Prefill: rows are the requests' chunks, right-padded to the longest; pad tokens take positions
past the row's real tokens (ForwardBatch's padding rule), clamped below max_seq_len. Admission
keeps prompt + max_new_tokens <= max_seq_len, so every position that is ever fed (at most
max_seq_len - 2) stays clear of the clamped pad position and no pad overwrites a real key.
Decode: one row per request, one token each, at that request's own position.
Every row names its cache slot (slot_ids), so the batch order need not follow the slots.
With `decode_graphs` (EngineConfig.cuda_graphs) the decode forward is a replayed CUDA graph.
"""

from collections.abc import Sequence

import torch

from infer.engine.cuda_graphs import DecodeGraphs
from infer.engine.request import Request
from infer.engine.sampler import sample_next_tokens
from infer.engine.scheduler import PrefillChunk
from infer.models.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_seq_len: int,
        decode_graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.kv_layers = kv_layers
        self.max_seq_len = max_seq_len
        self.decode_graphs = decode_graphs
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def prefill(self, work: Sequence[tuple[Request, PrefillChunk]]) -> list[int | None]:
        """Runs every chunk in one forward; returns the sampled token of each row whose chunk ends
        its prompt, None for the others (their prompt continues next step)."""
        rows = [request.prompt_ids[chunk.start : chunk.start + chunk.num_tokens] for request, chunk in work]
        starts = [chunk.start for _, chunk in work]
        requests = [request for request, _ in work]
        hidden = self._forward(rows, starts, requests)
        sampling_rows = [b for b, (_, chunk) in enumerate(work) if chunk.completes_prompt]
        tokens: list[int | None] = [None] * len(work)
        if sampling_rows:
            last_hidden = torch.stack([hidden[b, len(rows[b]) - 1] for b in sampling_rows])
            sampled = self._sample(
                self.model.compute_logits(last_hidden), [requests[b] for b in sampling_rows]
            )
            for b, token in zip(sampling_rows, sampled, strict=True):
                tokens[b] = token
        return tokens

    @torch.inference_mode()
    def decode(self, requests: Sequence[Request]) -> list[int]:
        """Feeds each request's last token at its own position, in one forward; samples the next."""
        starts = [request.num_computed_tokens for request in requests]
        if self.decode_graphs is not None:
            logits = self.decode_graphs.logits(
                [request.output_ids[-1] for request in requests],
                starts,
                [request.slot for request in requests],
            )
            return self._sample(logits, requests)
        hidden = self._forward([[request.output_ids[-1]] for request in requests], starts, requests)
        return self._sample(self.model.compute_logits(hidden[:, 0]), requests)

    def _forward(self, rows: list[list[int]], starts: list[int], requests: Sequence[Request]) -> torch.Tensor:
        width = max(len(row) for row in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        positions = (torch.tensor(starts)[:, None] + torch.arange(width)[None, :]).clamp(
            max=self.max_seq_len - 1
        )
        last_real_position = max(start + len(row) - 1 for start, row in zip(starts, rows, strict=True))
        batch = ForwardBatch(
            input_ids=input_ids.to(self.device),
            positions=positions.to(self.device),
            kv_layers=self.kv_layers,
            slot_ids=torch.tensor(
                [request.slot for request in requests], dtype=torch.long, device=self.device
            ),
            context_len=last_real_position + 1,
        )
        return self.model(batch)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        # The repetition penalty reads prompt + generated ids; other rows need no list.
        histories = [
            request.prompt_ids + request.output_ids if request.params.repetition_penalty != 1.0 else []
            for request in requests
        ]
        tokens = sample_next_tokens(
            logits,
            [request.params for request in requests],
            histories,
            [request.generator for request in requests],
        )
        return tokens.tolist()
