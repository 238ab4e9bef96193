"""One rank of a tensor-parallel run on the CPU over gloo, for test_tensor_parallel.py (run as a
script, one process per rank): for each checkpoint in turn, loads its shard, then writes the
logits of a cache-free batch of the prompts and the greedy continuation of each prompt, without
a cache and through a paged KV pool of the rank's KV heads, to OUT.<i>.rank<RANK> for the i-th
checkpoint. One process group serves every checkpoint: starting a rank (torch, transformers)
costs more than a tiny checkpoint's run.

    python tensor_parallel_rank.py RANK SIZE INIT_METHOD OUT PROMPTS_JSON NUM_TOKENS CHECKPOINT...
"""

import json
import sys

import torch
import torch.distributed as dist

# This folder is sys.path[0] when the script runs: test_greedy's loops drive the shard.
from test_greedy import greedy_with_cache, greedy_without_cache

from conformance.oracles import reference_8bit_linears
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.tensor_parallel import TensorParallel


def main() -> None:
    rank, size, init_method, out, prompts, num_tokens, *folders = sys.argv[1:]
    rank, size, prompts, num_tokens = int(rank), int(size), json.loads(prompts), int(num_tokens)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    try:
        for index, folder in enumerate(folders):
            model = load_causal_lm(folder, dtype=torch.float32, tensor_parallel=TensorParallel(rank, size))
            reference_8bit_linears(model)  # as the test does to its oracle
            torch.save(shard_results(model, prompts, num_tokens), f"{out}.{index}.rank{rank}")
    finally:
        dist.destroy_process_group()


@torch.inference_mode()
def shard_results(model, prompts: list[list[int]], num_tokens: int) -> dict:
    return {
        "logits": model.compute_logits(model(ForwardBatch.from_tokens(prompts))),
        "num_kv_heads": model.num_kv_heads,
        "greedy": [greedy_without_cache(model, prompt, num_tokens, set()) for prompt in prompts],
        "greedy_paged": [
            greedy_with_cache(model, prompt, num_tokens, set(), block_size=4) for prompt in prompts
        ],
    }


if __name__ == "__main__":
    main()
