"""On two GPUs (skipped with fewer): tensor parallelism over NCCL, with and without CUDA graphs
(which then capture the all-reduces), and two data-parallel replicas, each on a GPU of its own,
on real shapes in bf16: the recompute oracle's greedy tokens up to a bf16 near tie, as
test_gpu.py's single-GPU configurations."""

import pytest
import torch

from infer.engine import Engine, EngineConfig

from .test_gpu import assert_equal_up_to_a_near_tie, real_shape, run_together  # noqa: F401

TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def two_gpu_config(loaded, **settings) -> EngineConfig:
    return EngineConfig(
        model=str(loaded.path),
        device="cuda",
        dtype="bfloat16",
        max_batch_size=4,
        max_seq_len=1024,
        **settings,
    )


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("use_cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_two_tensor_parallel_ranks_give_the_recompute_tokens(real_shape, use_cuda_graphs):  # noqa: F811
    preset, loaded, prompts, params, expected = real_shape
    engine = Engine(two_gpu_config(loaded, tensor_parallel_size=2, use_cuda_graphs=use_cuda_graphs))
    try:
        tokens = run_together(engine, prompts, params)
    finally:
        engine.shutdown()
    for prompt, ours, oracle_tokens in zip(prompts, tokens, expected, strict=True):
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/tp2")


@pytest.mark.gpu
@TWO_GPUS
def test_two_data_parallel_replicas_give_the_recompute_tokens(real_shape):  # noqa: F811
    preset, loaded, prompts, params, expected = real_shape
    engine = Engine.spawn(two_gpu_config(loaded, data_parallel_size=2))
    try:
        tokens = run_together(engine, prompts, params)
        finished = [stats.num_finished for stats in engine.replica_stats()]
    finally:
        engine.shutdown()
    for prompt, ours, oracle_tokens in zip(prompts, tokens, expected, strict=True):
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/dp2")
    assert sum(finished) == len(prompts) and min(finished) > 0, finished
