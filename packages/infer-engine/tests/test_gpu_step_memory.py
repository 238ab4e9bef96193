"""On CUDA: a KV pool sized from free memory leaves the largest step the memory it needs
(infer.engine.step_memory), with the device's defaults (CUDA graphs, async scheduling, 256 rows)."""

import gc

import pytest
import torch

from infer.engine import Engine, EngineConfig, SamplingParams
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

from .test_gpu import run_together

NUM_TOKENS = 4


@pytest.mark.gpu
def test_the_widest_steps_run_under_a_tight_memory_limit(tmp_path):
    """4 GiB past the weights: a pool taking 0.9 of it before the steps' memory is known leaves
    about 400 MiB, less than the widest step needs (its logits and sampling of 256 rows over a
    128k vocabulary, in float32, peak above 1 GiB)."""
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path, dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    limit_bytes = torch.cuda.memory_reserved() + 4 * 2**30
    config = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_seq_len=2048,
        kv_cache_memory_fraction=0.9,
        device_memory_limit_gib=limit_bytes / 2**30,
    )
    try:
        engine = Engine(config, loaded_model=loaded)
        rows = engine.config.max_batch_size
        assert rows == 256 and engine.config.use_cuda_graphs
        # The scheduler's widest steps: every row at once, one a long prompt, each sampling on the
        # sampler's widest path (top-k and top-p sort the vocabulary; logprobs take its top 20).
        params = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, logprobs=20, max_new_tokens=NUM_TOKENS, ignore_eos=True
        )
        prompts = [[1, 2, 3]] * (rows - 1) + [list(range(1, 1501))]
        tokens = run_together(engine, prompts, params)
        assert [len(row) for row in tokens] == [NUM_TOKENS] * rows
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
