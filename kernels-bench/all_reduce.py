"""All-reduce latency by message size over N ranks of one host: what tensor parallelism pays per
row-parallel Linear. NCCL on CUDA, each all-reduce timed eagerly and as a CUDA graph replays it
(a decode step's graph captures its all-reduces); gloo on a CPU (what the CPU tests run).

An 8B model at TP=2 all-reduces 2 x 32 times a decode token (o_proj and down_proj of each
layer), 8 KiB each at batch 1 in bf16: the small sizes are the ones that decide whether batch-1
decode gains from a second GPU. Bus bandwidth is NCCL's: bytes x 2 (N - 1) / N over the time.

    python kernels-bench/all_reduce.py [NUM_RANKS] [SIZES]

SIZES: comma-separated byte counts with K or M suffixes (default 8K,16K,64K,256K,1M,4M,16M,64M).
Each rank sets NCCL_ENVIRONMENT (infer.engine.tensor_parallel) before NCCL starts, as the
engine's workers do.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infer.engine.tensor_parallel import NCCL_ENVIRONMENT
from infer.models.tensor_parallel import free_local_port

DEFAULT_SIZES = "8K,16K,64K,256K,1M,4M,16M,64M"
ITERATIONS = 200
# All-reduces captured in one graph: a replay's launch cost spread over them, as in a step.
PER_GRAPH = 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def timed_us(run, cuda: bool, iterations: int) -> float:
    """Mean microseconds per call of `run` (which does one all-reduce) over `iterations`."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            run()
        end.record()
        end.synchronize()
        return 1e3 * start.elapsed_time(end) / iterations
    started = time.perf_counter()
    for _ in range(iterations):
        run()
    return 1e6 * (time.perf_counter() - started) / iterations


def graph_us(x: torch.Tensor) -> float:
    """Microseconds per all-reduce of `x` when PER_GRAPH of them replay as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PER_GRAPH):
            dist.all_reduce(x)
    return timed_us(graph.replay, True, ITERATIONS // PER_GRAPH) / PER_GRAPH


def rank_main(rank: int, num_ranks: int, init_method: str, sizes: list[int], results) -> None:
    os.environ.update(NCCL_ENVIRONMENT)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=num_ranks
    )
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        rows = []
        for size in sizes:
            x = torch.ones(size // dtype.itemsize, dtype=dtype, device="cuda" if cuda else "cpu")
            for _ in range(5):
                dist.all_reduce(x)
            eager = timed_us(lambda x=x: dist.all_reduce(x), cuda, ITERATIONS)
            rows.append((size, eager, graph_us(x) if cuda else None))
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def main() -> None:
    num_ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    sizes = [parse_size(text) for text in (sys.argv[2] if len(sys.argv) > 2 else DEFAULT_SIZES).split(",")]
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < num_ranks:
        sys.exit(f"{num_ranks} ranks need {num_ranks} GPUs; {torch.cuda.device_count()} are visible")
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_local_port()}"
    processes = [
        context.Process(target=rank_main, args=(rank, num_ranks, init_method, sizes, results))
        for rank in range(num_ranks)
    ]
    for process in processes:
        process.start()
    rows = results.get(timeout=600)
    for process in processes:
        process.join(60)
    device = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
    print(f"all-reduce over {num_ranks} ranks, {device}, torch {torch.__version__}")
    print("| bytes | eager (us) | graph (us) | bus bandwidth, eager (GB/s) |")
    print("|---:|---:|---:|---:|")
    for size, eager, graph in rows:
        bus = size * 2 * (num_ranks - 1) / num_ranks / (eager * 1e-6) / 1e9
        graph_cell = f"{graph:.1f}" if graph is not None else "-"
        print(f"| {size} | {eager:.1f} | {graph_cell} | {bus:.2f} |")


if __name__ == "__main__":
    main()
