"""How much device memory serving takes beyond the weights and the KV pool: measured once at
start-up, before the pool takes its share of what is free (vLLM's profile run does the same).

The engine takes kv_cache_memory_fraction of the free memory (0.9 by default on CUDA, vLLM's
gpu_memory_utilization); the pool gets that less what is measured here, and the rest stays slack
for the allocator. Were the pool to take the whole share first, every step's activations, logits
and sampling, and the graphs, would have to fit in the slack: under a tight
device_memory_limit_gib the graph capture or the first full step would run out of memory.

The step measured is the largest the scheduler can make: max_batch_size rows, one of them a prompt
chunk that fills max_num_batched_tokens, every row sampling with top-k, top-p and logprobs (the
sampler's widest path: sorts over [rows, vocab]). It runs eagerly through a runner over a pool of
one block (every row's tokens land in the null block), which is dropped afterwards. The CUDA
graphs are not captured here (their kernels would hold the small pool's addresses): what they
hold is bounded by the step's peak (StepMemory.cuda_graphs).
"""

import gc
from dataclasses import dataclass

import torch

from infer.cache import KVCacheShape, PagedKVPool
from infer.engine.decision import NewRequest, ScheduleDecision
from infer.engine.runner import ModelRunner
from infer.engine.sampling_params import SamplingParams

# The sampler's widest path: every transform that sorts or gathers over the vocabulary.
_WIDEST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20)


def largest_step(
    max_batch_size: int, max_num_batched_tokens: int, max_seq_len: int, null_block: int, block_size: int
) -> ScheduleDecision:
    """The widest step: max_batch_size - 1 one-token prompts and one chunk with the rest of the
    step's tokens (at most max_seq_len - 1), every row sampling, every token in `null_block`."""
    # A prompt of max_seq_len tokens leaves no room for the token it samples.
    chunk = max(1, min(max_seq_len - 1, max_num_batched_tokens - (max_batch_size - 1)))
    lengths = [1] * (max_batch_size - 1) + [chunk]
    requests = tuple(
        NewRequest(
            request_id=f"profile-{row}",
            token_ids=(0,) * length,
            num_prompt_tokens=length,
            sampling=_WIDEST_SAMPLING,
            generator_seed=None,
            block_ids=(null_block,) * -(-length // block_size),
            num_computed_tokens=0,
        )
        for row, length in enumerate(lengths)
    )
    return ScheduleDecision(
        step=0,
        new_requests=requests,
        running_requests=(),
        num_scheduled_tokens={request.request_id: len(request.token_ids) for request in requests},
        num_prompt_tokens=sum(lengths),
    )


@dataclass(frozen=True)
class StepMemory:
    """What serving needs beyond the weights and the KV pool, in bytes."""

    # The runner's own buffers (its input batch, sampled-token buffers).
    runner_bytes: int
    # The largest step's peak beyond those: activations, logits, sampling.
    largest_step_bytes: int
    # Whether CUDA graphs are captured: their memory pool holds one captured forward's
    # intermediates (graphs share it, and are captured one at a time) and their shared logits
    # buffer, which the eager largest step's peak bounds (it holds those and its sampling's).
    cuda_graphs: bool

    @property
    def total_bytes(self) -> int:
        graphs = self.largest_step_bytes if self.cuda_graphs else 0
        return self.runner_bytes + self.largest_step_bytes + graphs


def measure_step_memory(
    model: torch.nn.Module,
    shape: KVCacheShape,
    *,
    max_batch_size: int,
    max_num_batched_tokens: int,
    max_seq_len: int,
    kernel_policy,
    use_cuda_graphs: bool,
) -> StepMemory:
    """Builds a runner as the engine will (over a one-block pool, without graphs) and measures
    its buffers and its largest step (CUDA only)."""
    device = next(model.parameters()).device
    pool = PagedKVPool(shape, num_blocks=1, device=device)
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    runner = ModelRunner(
        model,
        pool,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_num_batched_tokens=max_num_batched_tokens,
        kernel_policy=kernel_policy,
    )
    runner_bytes = torch.cuda.memory_allocated(device) - start
    decision = largest_step(
        max_batch_size, max_num_batched_tokens, max_seq_len, pool.null_block, pool.block_size
    )
    torch.cuda.synchronize(device)
    before_step = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(decision)
    torch.cuda.synchronize(device)
    largest_step_bytes = torch.cuda.max_memory_allocated(device) - before_step
    del runner, pool, decision
    gc.collect()
    torch.cuda.empty_cache()
    return StepMemory(max(0, runner_bytes), max(0, largest_step_bytes), use_cuda_graphs)
