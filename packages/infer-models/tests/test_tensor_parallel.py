"""Tensor parallelism on the CPU over gloo (infer.models.tensor_parallel), each rank a process of
its own (tensor_parallel_rank.py), as the engine's workers will be. The oracle is the same
checkpoint unsharded in this process: the ranks' logits within the fp32 parity bounds
(specs/parity/tolerances.yaml: the two differ only in summation order, as ours and transformers'
do), and the same greedy tokens, without a cache and through each rank's own paged KV pool (its
share of the KV heads)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conformance.oracles import reference_8bit_linears
from conformance.parity.checks import LogitGaps, tolerances_by_dtype
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.loader.fetch import fetch_model
from infer.models.random_checkpoint import make_random_checkpoint
from infer.models.tensor_parallel import TensorParallel, free_local_port

from .test_greedy import greedy_without_cache

RANK_SCRIPT = Path(__file__).with_name("tensor_parallel_rank.py")
# The rank script imports conformance, which lives at the repository's root (pytest's importlib
# mode puts nothing on sys.path for it).
REPOSITORY = Path(__file__).resolve().parents[3]
NUM_TOKENS = 8
PROMPTS = [[1, 17, 33, 5, 99, 250, 7], [3, 3, 200, 41]]
# Checkpoint, ranks, and each rank's KV heads: the tiny presets (llama and qwen3 split their 2 KV
# heads, gemma3-tiny replicates its one), and SmolLM2, whose 3 KV heads (9 query heads) split
# unevenly; and the tiny presets with int8 projections (one scale per output row), which shard
# as the dense ones do.
CASES = {
    "llama-tiny": (2, [1, 1]),
    "qwen3-tiny": (2, [1, 1]),
    "gemma3-tiny": (2, [1, 1]),
    "smollm2-135m-instruct": (2, [1, 2]),
    "llama-tiny-int8": (2, [1, 1]),
    "qwen3-tiny-int8": (2, [1, 1]),
    "gemma3-tiny-int8": (2, [1, 1]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    folders = {}
    for preset in ("llama-tiny", "qwen3-tiny", "gemma3-tiny"):
        folders[preset] = make_random_checkpoint(preset, root / preset, dtype=torch.float32)
        folders[f"{preset}-int8"] = make_random_checkpoint(
            preset, root / f"{preset}-int8", dtype=torch.float32, quantization="int8"
        )
    return {**folders, "smollm2-135m-instruct": fetch_model("smollm2-135m-instruct")}


def run_ranks(folders: list[Path], size: int, out: Path) -> list[list[dict]]:
    """For each folder, each rank's results (tensor_parallel_rank.py), the ranks run as processes
    over gloo, one process group for all the folders."""
    init_method = f"tcp://127.0.0.1:{free_local_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), *sys.path]), "OMP_NUM_THREADS": "1"}
    arguments = [str(size), init_method, str(out), json.dumps(PROMPTS), str(NUM_TOKENS), *map(str, folders)]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(rank), *arguments],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(size)
    ]
    for rank, process in enumerate(ranks):
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"rank {rank} failed:\n{output[-3000:]}"
    return [[torch.load(f"{out}.{i}.rank{rank}") for rank in range(size)] for i in range(len(folders))]


@pytest.fixture(scope="module")
def rank_results(checkpoints, tmp_path_factory) -> dict[str, list[dict]]:
    """Every case's ranks' results, from one launch of the ranks per size (a rank takes 6 s to
    start, longer than a tiny checkpoint's whole run)."""
    results = {}
    for size in sorted({size for size, _ in CASES.values()}):
        names = [name for name, (case_size, _) in CASES.items() if case_size == size]
        out = tmp_path_factory.mktemp("tp-ranks") / "result"
        results.update(zip(names, run_ranks([checkpoints[name] for name in names], size, out), strict=True))
    return results


@pytest.mark.parametrize("name", CASES)
def test_tensor_parallel_ranks_give_the_unsharded_models_logits_and_greedy_tokens(
    checkpoints, rank_results, name
):
    size, kv_heads = CASES[name]
    results = rank_results[name]
    model = load_causal_lm(checkpoints[name], dtype=torch.float32)
    reference_8bit_linears(model)  # as the rank script does
    with torch.inference_mode():
        expected = model.compute_logits(model(ForwardBatch.from_tokens(PROMPTS)))
        expected_greedy = [greedy_without_cache(model, prompt, NUM_TOKENS, set()) for prompt in PROMPTS]
    assert [result["num_kv_heads"] for result in results] == kv_heads
    for rank, result in enumerate(results):
        gaps = LogitGaps()
        gaps.add(result["logits"], expected)
        gaps.assert_within(tolerances_by_dtype()["float32"], f"rank {rank} against the unsharded model: ")
        assert result["greedy"] == expected_greedy, f"rank {rank}, without a cache"
        assert result["greedy_paged"] == expected_greedy, f"rank {rank}, paged"


def test_query_groups_that_do_not_split_over_the_ranks_are_refused(checkpoints):
    """qwen3-tiny's 2 KV heads over 3 ranks: each would hold one replicated KV head and share
    its 2 query heads with another rank, which does not go evenly."""
    with pytest.raises(ValueError, match=r"4 query heads in 2 KV heads do not split over 3 ranks"):
        load_causal_lm(checkpoints["qwen3-tiny"], tensor_parallel=TensorParallel(rank=0, size=3))
