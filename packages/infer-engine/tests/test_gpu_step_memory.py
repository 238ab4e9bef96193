"""On CUDA: a KV pool sized from free memory leaves the largest step the memory it needs
(infer.engine.step_memory), with the device's defaults (CUDA graphs, async scheduling, 256 rows).

The engine runs in a process of its own, as a server starts: the memory limit is on the process's
caching allocator, and a test process that ran other tests first holds segments they fragmented,
where a step's largest tensor may not fit though the bytes are free (the whole GPU suite ran out
of memory here, the test alone did not)."""

import gc
import subprocess
import sys

import pytest
import torch

from infer.models.random_checkpoint import make_random_checkpoint

NUM_TOKENS = 4


def run_widest_steps_under_limit(folder: str) -> None:
    """4 GiB past the weights: a pool taking 0.9 of it before the steps' memory is known leaves
    about 400 MiB, less than the widest step needs (its logits and sampling of 256 rows over a
    128k vocabulary, in float32, peak above 1 GiB)."""
    from infer.engine import Engine, EngineConfig, SamplingParams
    from infer.models.load import load_model

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
    engine = Engine(config, loaded_model=loaded)
    rows = engine.config.max_batch_size
    assert rows == 256 and engine.config.use_cuda_graphs
    # The scheduler's widest steps: every row at once, one a long prompt, each sampling on the
    # sampler's widest path (top-k and top-p sort the vocabulary; logprobs take its top 20).
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, logprobs=20, max_new_tokens=NUM_TOKENS, ignore_eos=True
    )
    prompts = [[1, 2, 3]] * (rows - 1) + [list(range(1, 1501))]
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens = {request_id: 0 for request_id in ids}
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            tokens[output.request_id] += output.token_id is not None
    assert list(tokens.values()) == [NUM_TOKENS] * rows


@pytest.mark.gpu
def test_the_widest_steps_run_under_a_tight_memory_limit(tmp_path):
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path, dtype=torch.bfloat16)
    child = subprocess.run(
        [sys.executable, __file__, str(folder)], capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, f"{child.stdout[-4000:]}\n{child.stderr[-8000:]}"


if __name__ == "__main__":
    run_widest_steps_under_limit(sys.argv[1])
