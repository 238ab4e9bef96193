"""ModelRunner.execute(decision) -> RunnerOutput: every scheduled token of a step in one forward.

Prompt chunks and decodes go through the same flat forward (`ForwardBatch`, decode rows first).
The runner builds the model once with its kernel policy (infer.models.kernel_policy: each
Linear's method, the fused pre-norm projections, the launch options), then selects a backend per
step: a step that fits the captured buckets replays a CUDA graph (`EngineConfig.use_cuda_graphs`,
and `cuda_graph_mixed_steps` for steps with prompt chunks); on a CPU, a step of decode rows runs
the C decoder stack where the policy allows the C kernels (infer.models.cpu_stack); every other
step runs the model's eager forward. Rows whose last scheduled token is
their last known token sample one token each, with the batched sampler; a mid-prompt chunk
samples nothing. The runner keeps each request's tokens in its `InputBatch` and appends what it
samples, so the next decision only says how many tokens to run.

`execute` is `launch`, `sample` then `collect`, plain calls in order: `launch(decision)` queues
the forward and returns at once, so that the caller fills the grammar masks of its sampling rows
while the device computes; `sample(launch, masks)` queues the sampling and the copy of its
tokens to the host; `collect()` waits for the oldest sampled step and returns its RunnerOutput.
Async scheduling (`EngineConfig.async_scheduling`) calls `collect` a step late: between the two
the host schedules and launches the next step while the device runs this one. A sampled
token's id is then unknown to the host when the next step feeds it back: the InputBatch holds
a placeholder, -(1 + j) for the j-th token the previous step sampled, and the forward reads the
id from `last_sampled`, the device copy of that step's tokens (`resolve_pending_tokens`).
"""

import dataclasses
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer.cache import COPY
from infer.engine.cuda_graphs import StepGraphs
from infer.engine.decision import RunnerOutput, ScheduleDecision, TokenLogprobs
from infer.engine.image_encoder import ImageEncoder, StepImages
from infer.engine.input_batch import InputBatch, RowState, StepInputs, resolve_pending_tokens
from infer.engine.pooling import Pooler, PoolingPlan
from infer.engine.prompt_logprobs import PendingPromptLogprobs, PromptLogprobsPlan, PromptScorer
from infer.engine.sampler import AllowedTokens, SamplingTensors, compute_logprobs, sample
from infer.engine.spec_decode.verify import VerifyRow, verify_drafts
from infer.kernels import decode_warm_up_lengths, native_cpu_kernels_available
from infer.models.cpu_stack import CpuDecodeStack
from infer.models.forward_batch import AttentionMetadata, ForwardBatch
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy

if TYPE_CHECKING:
    from infer.engine.spec_decode.draft_model import DraftModelProposer


@dataclass
class _LaunchedLogprobs:
    """The logprobs a step computed for its rows that asked, in that order, on their way to the
    host (tensors filled by copies queued before the step's `done` event)."""

    request_ids: list[str]
    num_top_logprobs: tuple[int, ...]
    sampled_logprobs: torch.Tensor  # [R] float32
    top_token_ids: torch.Tensor  # [R, K] int64
    top_logprobs: torch.Tensor  # [R, K] float32

    def entries(self) -> dict[str, tuple[TokenLogprobs, ...]]:
        """Per request, its tokens' TokenLogprobs in order (one, or one per verified position of
        a request verifying drafts: the scheduler keeps those of the tokens it emitted); read
        only once the step's copies are done."""
        sampled, top_ids, top_values = (
            self.sampled_logprobs.tolist(),
            self.top_token_ids.tolist(),
            self.top_logprobs.tolist(),
        )
        entries: dict[str, list[TokenLogprobs]] = {}
        for i, (request_id, k) in enumerate(zip(self.request_ids, self.num_top_logprobs, strict=True)):
            entries.setdefault(request_id, []).append(
                TokenLogprobs(sampled[i], top_ids[i][:k], top_values[i][:k])
            )
        return {request_id: tuple(tokens) for request_id, tokens in entries.items()}


@dataclass
class StepLaunch:
    """A step whose forward is queued (`ModelRunner.launch`) and not yet sampled."""

    request_ids: tuple[str, ...]
    # The rows that sample, in the order of `logits`' rows.
    sampling_ids: list[str]
    logits: torch.Tensor
    tensors: SamplingTensors | None
    # Speculative decoding: per sampling request, the draft tokens it verifies (() for none);
    # empty when no request verifies drafts (then sampling_ids are sampling rows).
    drafts: tuple[tuple[int, ...], ...] = ()
    # ScheduleDecision.draft_request_ids: whom a draft model drafts for once the step is collected.
    draft_request_ids: frozenset[str] | None = None
    # The step's image inputs, and what the vision tower encoded for it.
    images: StepImages | None = None
    # Pooling requests whose prompt ended in this step: their pooled vectors, on the device.
    pooled: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Prompt-logprobs requests whose prompt ended in this step: their results, on their way to
    # the host (infer.engine.prompt_logprobs).
    prompt_logprobs: dict[str, PendingPromptLogprobs] = dataclasses.field(default_factory=dict)


@dataclass
class _LaunchedStep:
    """A step whose sampled tokens are on their way to the host."""

    request_ids: tuple[str, ...]
    # Per sampled token: its request, that request's row then (the row may be gone or lent to
    # another request by the time the ids arrive), and the token's position in the row.
    sampled: list[tuple[str, RowState, int]]
    host_tokens: torch.Tensor  # [len(sampled)] int64, filled by a copy queued on the device
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU: already done)
    # Filled once the ids are read (`_read`).
    token_ids: list[int] | None = None
    # Set when a sampling row asked for logprobs.
    logprobs: _LaunchedLogprobs | None = None
    draft_request_ids: frozenset[str] | None = None  # StepLaunch's
    images: StepImages | None = None  # StepLaunch's
    # StepLaunch's pooled vectors, on their way to the host (complete with `done`).
    pooled: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # StepLaunch's prompt logprobs (complete with `done`).
    prompt_logprobs: dict[str, PendingPromptLogprobs] = dataclasses.field(default_factory=dict)


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
        async_scheduling: bool = False,
        kernel_policy: KernelPolicy | None = None,
        eos_token_ids: Collection[int] = (),
        draft: "DraftModelProposer | None" = None,
    ):
        """`kv_pool`: an infer.cache.KVPool (its kv_layers, block_size and null_block are used).
        `max_num_batched_tokens`: the most tokens a step holds (sizes the mixed-step graphs;
        None: max_seq_len). `async_scheduling`: a step may be launched before the previous one is
        collected (the graphs then resolve placeholders). `kernel_policy`: what the model runs,
        applied to it here, once (None: `KernelPolicy(device)`, the plain ATen paths); its C
        kernels also select the CPU decode stack. `eos_token_ids`: the model's EOS set, which a
        request's min_tokens keeps out."""
        self.async_scheduling = async_scheduling
        self.eos_token_ids = tuple(eos_token_ids)
        # Speculative decoding with a draft model: it drafts for each request that sampled, as
        # its step is collected (infer.engine.spec_decode.draft_model).
        self.draft = draft
        self.model = model
        self.kv_pool = kv_pool
        self.kv_layers = kv_pool.kv_layers
        self.kv_scales = kv_pool.kv_scales
        self.device = next(model.parameters()).device
        self.kernel_policy = kernel_policy or KernelPolicy(self.device)
        apply_kernel_policy(model, self.kernel_policy)
        # The CPU decode backend (None: every step takes the model's forward).
        self.cpu_decode = None
        # The C stack runs the whole model's layers: not a tensor-parallel shard's.
        if self.device.type == "cpu" and self.kernel_policy.use_native_cpu_kernels and model.tp is None:
            self.cpu_decode = CpuDecodeStack.for_model(model)
        # A vision-language model's tower, run when a step first needs an image (image_encoder).
        self.image_encoder = None
        self.pooler = Pooler()  # embedding requests (infer.engine.pooling)
        self.prompt_scorer = PromptScorer()  # prompt-logprobs requests (infer.engine.prompt_logprobs)
        if model.vision is not None:
            self.image_encoder = ImageEncoder(model.vision, bidirectional=model.vision.layout.bidirectional)
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
        # The tokens the latest launched step sampled, in its sampling order, on the device: the
        # next step's placeholders read them (see the module docstring).
        self.last_sampled = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        # Two pinned host buffers for sampled ids, used in turn: a step's ids are read before
        # the step after next is launched, so one launch never overwrites ids still unread.
        pinned = self.device.type == "cuda"
        self._host_tokens = torch.zeros((2, max_batch_size), dtype=torch.long, pin_memory=pinned)
        self._num_launched = 0
        self._launched: deque[_LaunchedStep] = deque()
        # Offloads and restores queued and not yet reported: CUDA events (start, end), or seconds.
        self._store_timings: deque = deque()
        self.graphs = None
        if use_cuda_graphs:
            self.graphs = StepGraphs(
                model,
                self.kv_layers,
                kv_scales=self.kv_scales,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                max_num_batched_tokens=max_num_batched_tokens or max_seq_len,
                block_size=kv_pool.block_size,
                null_block=kv_pool.null_block,
                mixed_steps=cuda_graph_mixed_steps,
                last_sampled=self.last_sampled if async_scheduling else None,
            )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs eager forwards shaped like the steps serving will run, so that every Triton kernel
        variant (one-split and split decode rows, prompt chunks after decode rows) is compiled
        now and not on the step of whichever request first needs it (graph capture compiles the
        graphs' own; a step no graph holds runs eagerly). Only the null block is
        written. A CPU has infer.kernels' C kernels to build (KernelPolicy.use_native_cpu_kernels),
        once a machine."""
        if self.device.type != "cuda":
            if self.kernel_policy.use_native_cpu_kernels:
                native_cpu_kernels_available()
            return
        block_size = self.input_batch.block_size
        null_slot = self.null_block * block_size
        # Split decode (each split-merge variant, eager steps' split counts follow their
        # longest row) and one-split decode.
        num_kv_heads = self.kv_layers[0][0].shape[2]
        for decode_len in (1, *decode_warm_up_lengths(num_kv_heads, self.max_seq_len), self.max_seq_len):
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
            if self.kernel_policy.pdl:  # a one-token step launches the kernels' PDL variants
                decode_only = StepInputs(
                    request_ids=step.request_ids[:1],
                    input_ids=step.input_ids[:1],
                    positions=positions[:1],
                    slot_mapping=step.slot_mapping[:1],
                    query_start_loc=step.query_start_loc[:2],
                    seq_lens=step.seq_lens[:1],
                    block_tables=step.block_tables[:1],
                    num_decode_rows=1,
                    sampling_rows=[0],
                    logits_indices=step.logits_indices[:1],
                )
                self._eager_logits(decode_only)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, decision: ScheduleDecision) -> RunnerOutput:
        """Runs the step and returns what it sampled (`launch`, `sample`, then `collect`)."""
        self.sample(self.launch(decision))
        return self.collect()

    @torch.inference_mode()
    def launch(self, decision: ScheduleDecision) -> StepLaunch:
        """Queues the step's forward on the device without waiting for it. The caller then fills
        the grammar masks of `StepLaunch.sampling_ids` while the device computes, and passes
        them to `sample`."""
        if self._launched and not self.async_scheduling:
            raise RuntimeError("a step is launched and not collected; only async_scheduling launches ahead")
        self.input_batch.apply(decision)
        self.pooler.forget(decision.finished_request_ids | decision.preempted_request_ids)
        self.prompt_scorer.forget(decision.finished_request_ids | decision.preempted_request_ids)
        for request in decision.new_requests:
            self.pooler.add(request.request_id, request.sampling.pooling)
            self.prompt_scorer.add(request)
        if self.draft is not None:
            self.draft.forget(decision.finished_request_ids | decision.preempted_request_ids)
        if self.image_encoder is not None:
            self.image_encoder.forget(decision.finished_request_ids | decision.preempted_request_ids)
            for request in decision.new_requests:
                prompt_ids = request.token_ids[: request.num_prompt_tokens]
                self.image_encoder.add(request.request_id, request.images, prompt_ids)
        # Prefix-cache block copies, offloads and restores, queued before the forward that reads
        # or overwrites those blocks.
        self._run_block_ops(decision.block_ops)
        if decision.new_requests or decision.finished_request_ids or decision.preempted_request_ids:
            self._sampling = None
        if decision.is_empty:
            return StepLaunch((), [], torch.empty(0), None, draft_request_ids=decision.draft_request_ids)
        step = self.input_batch.prepare(decision)
        images = None
        if self.image_encoder is not None:
            images = self.image_encoder.step_images(step)
            rope = self.image_encoder.rope_positions(step)
            if rope is not None:  # M-RoPE: text rotates by one position, images by three
                step = dataclasses.replace(step, positions=rope[0])
                if images is not None:
                    images.mrope_positions = rope[1]
        pooling = self.pooler.plan(step, self.input_batch.states)
        scoring = self.prompt_scorer.plan(step, self.input_batch)
        if pooling is None and scoring is None:
            logits, pooled, prompt_logprobs = self._logits(step, images), {}, {}
        else:
            logits, pooled, prompt_logprobs = self._logits_and_hidden(step, images, pooling, scoring)
        sampling_ids = [step.request_ids[row] for row in step.sampling_rows]
        if step.verifies_drafts:
            # One entry per request (its K + 1 rows are consecutive); verify_drafts builds the
            # settings of every verified position itself.
            sampling_ids = list(dict.fromkeys(sampling_ids))
            return StepLaunch(
                tuple(dict.fromkeys(step.request_ids)),
                sampling_ids,
                logits,
                None,
                step.drafts,
                draft_request_ids=decision.draft_request_ids,
                pooled=pooled,
                prompt_logprobs=prompt_logprobs,
            )
        tensors = self._sampling_tensors(tuple(sampling_ids)) if sampling_ids else None
        drafting = decision.draft_request_ids
        return StepLaunch(
            tuple(step.request_ids),
            sampling_ids,
            logits,
            tensors,
            draft_request_ids=drafting,
            images=images,
            pooled=pooled,
            prompt_logprobs=prompt_logprobs,
        )

    @torch.inference_mode()
    def sample(self, launch: StepLaunch, masks: AllowedTokens | None = None) -> None:
        """Queues the sampling of a launched step (under `masks`: the grammar masks of its
        sampling rows, row i being launch.sampling_ids[i]) and the copy of its tokens to the
        host; its RunnerOutput comes from a later `collect()`, in launch order."""
        sampling_ids = launch.sampling_ids
        if not launch.request_ids:
            empty = self._host_tokens[0, :0]
            drafting = launch.draft_request_ids
            self._launched.append(_LaunchedStep((), [], empty, None, draft_request_ids=drafting))
            return
        if launch.drafts:
            self._sample_verified(launch, masks)
            return
        host_tokens = self._host_tokens[self._num_launched % 2, : len(sampling_ids)]
        self._num_launched += 1
        done = None
        logprobs = None
        pooled = {}
        if sampling_ids:
            tensors, logits = launch.tensors, launch.logits
            tokens = self._sample(logits, sampling_ids, tensors, masks)
            self.last_sampled[: len(tokens)].copy_(tokens)
            host_tokens.copy_(tokens, non_blocking=True)
            if tensors.logprobs_rows:
                # `logits` are still the model's (sample() transforms copies); with CUDA graphs
                # they are the graph's output buffer, which the next replay, queued after this
                # on the same stream, overwrites only once these kernels have read it.
                logprobs = self._launch_logprobs(logits, tokens, tensors, sampling_ids)
            pooled = {rid: vector.to("cpu", non_blocking=True) for rid, vector in launch.pooled.items()}
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        # Each sampling row's next token is a placeholder until its id is read.
        sampled = []
        for index, request_id in enumerate(sampling_ids):
            state = self.input_batch.states[request_id]
            sampled.append((request_id, state, self.input_batch.append_token(request_id, -1 - index)))
        self._launched.append(
            _LaunchedStep(
                launch.request_ids,
                sampled,
                host_tokens,
                done,
                logprobs=logprobs,
                draft_request_ids=launch.draft_request_ids,
                images=launch.images,
                pooled=pooled,
                prompt_logprobs=launch.prompt_logprobs,
            )
        )

    def _sample_verified(self, launch: StepLaunch, masks: AllowedTokens | None) -> None:
        """`sample` for a step whose rows verify draft tokens (infer.engine.spec_decode.verify):
        each row keeps its accepted drafts and gains the target's token. The engine overlaps no
        step with one that verifies drafts (Scheduler.speculates_after), so the tokens are read
        here and the step is collected with them."""
        if self._launched:
            raise RuntimeError("a step that verifies drafts is sampled with no other step in flight")
        batch = self.input_batch
        rows = []
        for request_id, drafts in zip(launch.sampling_ids, launch.drafts, strict=True):
            state = batch.states[request_id]
            rows.append(
                VerifyRow(
                    request_id,
                    state.sampling,
                    state.generator,
                    batch.history(request_id),
                    state.num_prompt_tokens,
                    drafts,
                )
            )
        verified = verify_drafts(launch.logits, rows, masks, eos_token_ids=self.eos_token_ids)
        logprobs = None
        if verified.tensors.logprobs_rows:
            logprobs = self._launch_logprobs(
                launch.logits, verified.position_tokens, verified.tensors, verified.position_request_ids
            )
        sampled, token_ids = [], []
        for row, tokens in zip(rows, verified.tokens, strict=True):
            state = batch.states[row.request_id]
            batch.truncate(row.request_id, row.num_known_tokens)  # the drafts go; kept ones return
            for token in tokens:
                sampled.append((row.request_id, state, batch.append_token(row.request_id, token)))
                token_ids.append(token)
        self._launched.append(
            _LaunchedStep(
                launch.request_ids,
                sampled,
                torch.tensor(token_ids),
                None,
                token_ids=token_ids,
                logprobs=logprobs,
                draft_request_ids=launch.draft_request_ids,
                pooled={rid: vector.cpu() for rid, vector in launch.pooled.items()},
                prompt_logprobs=launch.prompt_logprobs,
            )
        )

    def _launch_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, tensors: SamplingTensors, sampling_ids: list[str]
    ) -> _LaunchedLogprobs:
        """Queues the logprobs of the rows that asked and their copies to the host."""
        # to("cpu", non_blocking=True) from a CUDA tensor lands in pinned memory: an
        # asynchronous copy, complete once the step's `done` event (recorded after it) is.
        sampled_logprobs, top_ids, top_logprobs = (
            tensor.to("cpu", non_blocking=True) for tensor in compute_logprobs(logits, tokens, tensors)
        )
        return _LaunchedLogprobs(
            request_ids=[sampling_ids[row] for row in tensors.logprobs_rows],
            num_top_logprobs=tensors.num_top_logprobs,
            sampled_logprobs=sampled_logprobs,
            top_token_ids=top_ids,
            top_logprobs=top_logprobs,
        )

    def _run_block_ops(self, ops) -> None:
        """Runs the step's block operations; those that move blocks to or from the pool's store are
        timed on the step's stream (device time on CUDA: a host tier's copies over the bus run on
        streams of their own, and what is timed is what the step waits for), for
        RunnerOutput.store_transfer_s."""
        if all(op.kind == COPY for op in ops):
            self.kv_pool.run_block_ops(ops)
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.kv_pool.run_block_ops(ops)
            end.record()
            self._store_timings.append((start, end))
        else:
            started_s = time.perf_counter()
            self.kv_pool.run_block_ops(ops)
            self._store_timings.append(time.perf_counter() - started_s)

    def _store_transfer_s(self) -> float:
        """Seconds of the timed block operations done by now (a later step's, still queued behind
        this one's forward, waits for a later collect rather than for the device)."""
        seconds = 0.0
        while self._store_timings:
            timing = self._store_timings[0]
            if isinstance(timing, tuple):
                start, end = timing
                if not end.query():
                    break
                timing = start.elapsed_time(end) / 1000
            seconds += timing
            self._store_timings.popleft()
        return seconds

    def collect(self) -> RunnerOutput:
        """The output of the oldest launched step not collected yet; waits for its tokens."""
        launched = self._launched.popleft()
        token_ids = self._read(launched)
        # One token per sampling row; a row that verified drafts may have several.
        sampled: dict[str, list[int]] = {}
        for (request_id, _, _), token in zip(launched.sampled, token_ids, strict=True):
            sampled.setdefault(request_id, []).append(token)
        spec_token_ids = {}
        wanted = launched.draft_request_ids
        if self.draft is not None and wanted != frozenset():
            if self._launched:
                # The drafts continue each row's tokens: none may be a later step's placeholder.
                raise RuntimeError("the draft model drafts after a step with no later step in flight")
            drafting = [request_id for request_id in sampled if wanted is None or request_id in wanted]
            spec_token_ids = self.draft.propose(self.input_batch, drafting)
        return RunnerOutput(
            spec_token_ids=spec_token_ids,
            request_ids=launched.request_ids,
            sampled_token_ids=tuple(
                tuple(sampled.get(request_id, ())) for request_id in launched.request_ids
            ),
            logprobs=launched.logprobs.entries() if launched.logprobs is not None else {},
            images_encoded=launched.images.encoded_seconds() if launched.images is not None else {},
            store_transfer_s=self._store_transfer_s(),
            pooled={rid: vector.numpy() for rid, vector in launched.pooled.items()},
            prompt_logprobs={rid: pending.read() for rid, pending in launched.prompt_logprobs.items()},
        )

    def _read(self, launched: _LaunchedStep) -> list[int]:
        """Waits for the step's sampled ids and writes them over their placeholders (in rows
        that still hold the same request)."""
        if launched.token_ids is None:
            if launched.done is not None:
                launched.done.synchronize()
            launched.token_ids = launched.host_tokens.tolist()
            states = self.input_batch.states
            for (request_id, state, position), token in zip(
                launched.sampled, launched.token_ids, strict=True
            ):
                if states.get(request_id) is state:
                    self.input_batch.token_ids[state.row, position] = token
        return launched.token_ids

    @torch.inference_mode()
    def draft_logits(self, step: StepInputs) -> torch.Tensor:
        """The logits of `step`'s sampling rows, on this runner's model and pool, for a draft
        model's proposer: the forward alone, nothing sampled and no row kept."""
        return self._logits(step)

    def _logits(self, step: StepInputs, images: StepImages | None = None) -> torch.Tensor:
        """Logits of the sampling rows, in order. A step with image tokens runs eagerly: the
        graphs hold text steps."""
        if self.graphs is not None and images is None:
            logits = self.graphs.logits(step)
            if logits is not None:
                return logits
        return self._eager_logits(step, images)

    def _logits_and_hidden(
        self,
        step: StepInputs,
        images: StepImages | None,
        pooling: PoolingPlan | None,
        scoring: PromptLogprobsPlan | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, PendingPromptLogprobs]]:
        """The logits of the sampling rows, the pooled vectors of the pooling requests whose
        prompt ends here and the prompt logprobs of the prompt-logprobs requests whose prompt
        ends here, from one eager forward that returns the final hidden states of the sampling
        rows' last tokens, then of the pooling plan's tokens (infer.engine.pooling), then of the
        scoring plan's (infer.engine.prompt_logprobs)."""
        num_sampling = len(step.logits_indices)
        num_pooling = len(pooling.extra_indices) if pooling is not None else 0
        indices = [step.logits_indices]
        indices += [plan.extra_indices for plan in (pooling, scoring) if plan is not None]
        batch = self.forward_batch(step, logits_indices=np.concatenate(indices), images=images)
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[:num_sampling]) if num_sampling else torch.empty(0)
        pooled, prompt_logprobs = {}, {}
        if pooling is not None:
            pooling_hidden = hidden[num_sampling : num_sampling + num_pooling]
            pooled = self.pooler.pool(pooling, hidden[:num_sampling], pooling_hidden, self.input_batch.states)
        if scoring is not None:
            scoring_hidden = hidden[num_sampling + num_pooling :]
            prompt_logprobs = self.prompt_scorer.score(scoring, scoring_hidden, self.model.compute_logits)
        return logits, pooled, prompt_logprobs

    def _eager_logits(self, step: StepInputs, images: StepImages | None = None) -> torch.Tensor:
        if not step.sampling_rows:
            # Mid-prompt chunks only: the forward still fills the cache.
            self._forward(self.forward_batch(step, logits_indices=np.zeros(1, dtype=np.int64), images=images))
            return torch.empty(0)
        batch = self.forward_batch(step, logits_indices=step.logits_indices, images=images)
        if self.cpu_decode is not None and self.cpu_decode.takes(batch):
            return self.cpu_decode.logits(batch)
        return self.model.compute_logits(self.model(batch))

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward of `batch`, through the CPU decode stack where it takes the step."""
        if self.cpu_decode is not None and self.cpu_decode.takes(batch):
            return self.cpu_decode(batch)
        return self.model(batch)

    def _decode_key_slots(self, step: StepInputs) -> tuple[torch.Tensor | range, ...]:
        """Each decode row's key slots through its block table (AttentionMetadata.decode_key_slots):
        a `range` where its blocks are consecutive, as the allocator's first-in-first-out free
        list mostly hands them to a lone sequence."""
        block_size = self.kv_pool.block_size
        slots = []
        for row in range(step.num_decode_rows):
            seq_len = int(step.seq_lens[row])
            blocks = step.block_tables[row, : -(-seq_len // block_size)].astype(np.int64)
            if np.array_equal(blocks, np.arange(blocks[0], blocks[0] + len(blocks))):
                start = int(blocks[0]) * block_size
                slots.append(range(start, start + seq_len))
            else:
                positions = np.arange(seq_len)
                blocks = blocks[positions // block_size]
                slots.append(torch.from_numpy(blocks * block_size + positions % block_size))
        return tuple(slots)

    def forward_batch(
        self, step: StepInputs, *, logits_indices: np.ndarray, images: StepImages | None = None
    ) -> ForwardBatch:
        def device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

        lookahead = images.lookahead if images is not None else None
        metadata = AttentionMetadata(
            query_start_loc=device(step.query_start_loc),
            seq_lens=device(step.seq_lens),
            slot_mapping=device(step.slot_mapping),
            block_tables=device(step.block_tables),
            num_decode_rows=step.num_decode_rows,
            max_query_len=int(np.diff(step.query_start_loc).max()),
            max_seq_len=int(step.seq_lens.max()),
            decode_key_slots=self._decode_key_slots(step) if self.device.type == "cpu" else None,
            lookahead=device(lookahead) if lookahead is not None else None,
        )
        input_ids = device(step.input_ids)
        if step.input_ids.min(initial=0) < 0:
            resolve_pending_tokens(input_ids, self.last_sampled)
        return ForwardBatch(
            input_ids=input_ids,
            positions=device(step.positions),
            attention=metadata,
            kv_layers=self.kv_layers,
            kv_scales=self.kv_scales,
            logits_indices=device(logits_indices),
            image_embeds=images.embeds if images is not None else None,
            image_token_indices=device(images.token_indices) if images is not None else None,
            mrope_positions=(
                device(images.mrope_positions)
                if images is not None and images.mrope_positions is not None
                else None
            ),
        )

    def _sample(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        tensors: SamplingTensors,
        allowed: AllowedTokens | None = None,
    ) -> torch.Tensor:
        batch = self.input_batch
        if tensors.reads_token_ids or tensors.reads_output_ids:
            # Penalties and min_tokens read the rows' ids on the host: no placeholders there.
            for launched in self._launched:
                self._read(launched)
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
        return sample(logits, tensors, histories, outputs, allowed)

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
