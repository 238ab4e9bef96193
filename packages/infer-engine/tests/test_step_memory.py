"""The step that start-up measures before sizing the KV pool (infer.engine.step_memory): it is a
step the runner takes, as wide as the limits allow. Its memory is measured on CUDA only
(test_gpu_step_memory.py)."""

import pytest

from infer.cache import KVCacheShape, PagedKVPool
from infer.engine.runner import ModelRunner
from infer.engine.step_memory import largest_step


@pytest.mark.parametrize(
    ("max_batch_size", "max_num_batched_tokens", "max_seq_len", "chunk"),
    [(8, 64, 128, 57), (8, 64, 32, 31), (8, 8, 128, 1)],
    ids=["chunk-fills-the-step", "chunk-capped-by-max-seq-len", "rows-fill-the-step"],
)
def test_the_largest_step_runs_every_row_and_each_samples(
    tiny_models, max_batch_size, max_num_batched_tokens, max_seq_len, chunk
):
    model = tiny_models["llama-tiny"].loaded.model
    config = model.config
    shape = KVCacheShape(config.num_layers, config.num_kv_heads, config.head_dim, model.dtype, block_size=16)
    pool = PagedKVPool(shape, num_blocks=1)
    runner = ModelRunner(model, pool, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    decision = largest_step(
        max_batch_size, max_num_batched_tokens, max_seq_len, pool.null_block, pool.block_size
    )
    lengths = list(decision.num_scheduled_tokens.values())
    assert lengths == [1] * (max_batch_size - 1) + [chunk]
    output = runner.execute(decision)
    assert [len(tokens) for tokens in output.sampled_token_ids] == [1] * max_batch_size
    assert set(output.logprobs) == set(decision.num_scheduled_tokens)
