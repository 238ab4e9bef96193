"""ModelRunner.execute(decision) -> RunnerOutput: every scheduled token of a step in one forward.

Prompt chunks and decodes go through the same flat forward (`ForwardBatch`, decode rows first);
a step that fits the captured buckets replays a CUDA graph instead (`EngineConfig.use_cuda_graphs`,
and `cuda_graph_mixed_steps` for steps with prompt chunks). Rows whose last scheduled token is
their last known token sample one token each, with the batched sampler; a mid-prompt chunk
samples nothing. The runner keeps each request's tokens in its `InputBatch` and appends what it
samples, so the next decision only says how many tokens to run.
"""

from collections.abc import Collection, Sequence

import numpy as np
import torch

from infer.engine.cuda_graphs import StepGraphs
from infer.engine.decision import RunnerOutput, ScheduleDecision
from infer.engine.input_batch import InputBatch, StepInputs
from infer.engine.sampler import SamplingTensors, sample
from infer.models.forward_batch import AttentionMetadata, ForwardBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool,
        *,
        max_batch_size: int,
        max_seq_len: int,
        max_num_batched_tokens: int | None = None,
        use_cuda_graphs: bool = False,
        cuda_graph_mixed_steps: bool = True,
        eos_token_ids: Collection[int] = (),
    ):
        """`kv_pool`: an infer.cache.KVPool (its kv_layers, block_size and null_block are used).
        `max_num_batched_tokens`: the most tokens a step holds (sizes the mixed-step graphs;
        None: max_seq_len). `eos_token_ids`: the model's EOS set, which a request's min_tokens
        keeps out."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.model = model
        self.kv_layers = kv_pool.kv_layers
        self.device = next(model.parameters()).device
        self.input_batch = InputBatch(
            max_rows=max_batch_size,
            max_seq_len=max_seq_len,
            block_size=kv_pool.block_size,
            device=self.device,
        )
        self.null_block = kv_pool.null_block
        self.max_seq_len = max_seq_len
        # (request ids that sampled last step, their SamplingTensors)
        self._sampling: tuple[tuple[str, ...], SamplingTensors] | None = None
        self.graphs = None
        if use_cuda_graphs:
            self.graphs = StepGraphs(
                model,
                self.kv_layers,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                max_num_batched_tokens=max_num_batched_tokens or max_seq_len,
                block_size=kv_pool.block_size,
                null_block=kv_pool.null_block,
                mixed_steps=cuda_graph_mixed_steps,
            )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs eager forwards shaped like the steps serving will run, so that every Triton kernel
        variant (one-split and split decode rows, prompt chunks after decode rows) is compiled
        now and not on the step of whichever request first needs it (graph capture compiles the
        graphs' own; a step no graph holds runs eagerly). Only the null block is
        written. CPU runs the kernels' PyTorch references and has nothing to compile."""
        if self.device.type != "cuda":
            return
        block_size = self.input_batch.block_size
        null_slot = self.null_block * block_size
        for decode_len in (1, self.max_seq_len):
            # Row 0 decodes at position decode_len - 1; row 1 is a two-token prompt chunk.
            positions = np.array([decode_len - 1, 0, 1], dtype=np.int64)
            step = StepInputs(
                request_ids=["warm-up-decode", "warm-up-chunk"],
                input_ids=np.zeros(3, dtype=np.int64),
                positions=positions,
                slot_mapping=null_slot + positions % block_size,
                query_start_loc=np.array([0, 1, 3], dtype=np.int32),
                seq_lens=np.array([decode_len, 2], dtype=np.int32),
                block_tables=np.full((2, self.input_batch.max_blocks), self.null_block, dtype=np.int32),
                num_decode_rows=1,
                sampling_rows=[0, 1],
                logits_indices=np.array([0, 2], dtype=np.int64),
            )
            self._eager_logits(step)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, decision: ScheduleDecision) -> RunnerOutput:
        self.input_batch.apply(decision)
        if decision.new_requests or decision.finished_request_ids or decision.preempted_request_ids:
            self._sampling = None
        if decision.is_empty:
            return RunnerOutput((), ())
        step = self.input_batch.prepare(decision)
        logits = self._logits(step)
        sampling_ids = [step.request_ids[row] for row in step.sampling_rows]
        tokens = self._sample(logits, sampling_ids) if sampling_ids else []
        sampled = dict(zip(sampling_ids, tokens, strict=True))
        for request_id, token in sampled.items():
            self.input_batch.append_token(request_id, token)
        return RunnerOutput(
            request_ids=tuple(step.request_ids),
            sampled_token_ids=tuple((sampled[rid],) if rid in sampled else () for rid in step.request_ids),
        )

    def _logits(self, step: StepInputs) -> torch.Tensor:
        """Logits of the sampling rows, in order."""
        if self.graphs is not None:
            logits = self.graphs.logits(step)
            if logits is not None:
                return logits
        return self._eager_logits(step)

    def _eager_logits(self, step: StepInputs) -> torch.Tensor:
        if not step.sampling_rows:
            # Mid-prompt chunks only: the forward still fills the cache.
            self.model(self.forward_batch(step, logits_indices=np.zeros(1, dtype=np.int64)))
            return torch.empty(0)
        hidden = self.model(self.forward_batch(step, logits_indices=step.logits_indices))
        return self.model.compute_logits(hidden)

    def forward_batch(self, step: StepInputs, *, logits_indices: np.ndarray) -> ForwardBatch:
        def device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

        metadata = AttentionMetadata(
            query_start_loc=device(step.query_start_loc),
            seq_lens=device(step.seq_lens),
            slot_mapping=device(step.slot_mapping),
            block_tables=device(step.block_tables),
            num_decode_rows=step.num_decode_rows,
            max_query_len=int(np.diff(step.query_start_loc).max()),
            max_seq_len=int(step.seq_lens.max()),
        )
        return ForwardBatch(
            input_ids=device(step.input_ids),
            positions=device(step.positions),
            attention=metadata,
            kv_layers=self.kv_layers,
            logits_indices=device(logits_indices),
        )

    def _sample(self, logits: torch.Tensor, request_ids: Sequence[str]) -> list[int]:
        tensors = self._sampling_tensors(tuple(request_ids))
        batch = self.input_batch
        # The repetition penalty reads prompt + generated ids, which grow every step.
        histories = (
            [
                batch.history(rid) if batch.states[rid].sampling.repetition_penalty != 1.0 else []
                for rid in request_ids
            ]
            if tensors.reads_token_ids
            else ()
        )
        outputs = [batch.output_ids(rid) for rid in request_ids] if tensors.reads_output_ids else ()
        return sample(logits, tensors, histories, outputs).tolist()

    def _sampling_tensors(self, request_ids: tuple[str, ...]) -> SamplingTensors:
        """The batch's SamplingTensors, rebuilt when other requests (or the same ones in another
        order) sample than in the previous step, or when rows came or went (`execute` drops them
        then: an id may come back as another request, or resumed with a new generator)."""
        if self._sampling is None or self._sampling[0] != request_ids:
            states = [self.input_batch.states[rid] for rid in request_ids]
            tensors = SamplingTensors.build(
                [state.sampling for state in states],
                [state.generator for state in states],
                self.device,
                eos_token_ids=self.eos_token_ids,
            )
            self._sampling = (request_ids, tensors)
        return self._sampling[1]
