"""One rank of a tensor-parallel run on the CPU over gloo, for test_tensor_parallel.py (run as a
script, one process per rank): loads its shard of the checkpoint, then writes (rank 0) the
logits of a cache-free batch of the prompts and the greedy continuation of each prompt, without
a cache and through a paged KV pool of the rank's KV heads.

    python tensor_parallel_rank.py CHECKPOINT RANK SIZE INIT_METHOD OUT PROMPTS_JSON NUM_TOKENS
"""

import json
import sys

import torch
import torch.distributed as dist

from conformance.paged_batches import PagedRow, grow, paged_batch, scrambled_pool
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.tensor_parallel import TensorParallel


@torch.inference_mode()
def greedy(model, prompt: list[int], num_tokens: int, *, paged: bool) -> list[int]:
    pool = scrambled_pool(model, 4, len(prompt) + num_tokens) if paged else None
    block_ids: list[int] = []
    tokens, num_cached = list(prompt), 0
    for _ in range(num_tokens):
        if pool is None:
            batch = ForwardBatch.from_tokens([tokens])
        else:
            grow(pool, block_ids, len(tokens), "sequence")
            batch = paged_batch(pool, [PagedRow(block_ids, num_cached, tokens[num_cached:])])
            num_cached = len(tokens)
        tokens.append(int(model.compute_logits(model(batch)[-1:]).argmax(-1)))
    return tokens[len(prompt) :]


def main() -> None:
    folder, rank, size, init_method, out, prompts, num_tokens = sys.argv[1:8]
    rank, size, prompts, num_tokens = int(rank), int(size), json.loads(prompts), int(num_tokens)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    try:
        model = load_causal_lm(folder, dtype=torch.float32, tensor_parallel=TensorParallel(rank, size))
        with torch.inference_mode():
            logits = model.compute_logits(model(ForwardBatch.from_tokens(prompts)))
        result = {
            "logits": logits,
            "num_kv_heads": model.num_kv_heads,
            "greedy": [greedy(model, prompt, num_tokens, paged=False) for prompt in prompts],
            "greedy_paged": [greedy(model, prompt, num_tokens, paged=True) for prompt in prompts],
        }
        torch.save(result, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
