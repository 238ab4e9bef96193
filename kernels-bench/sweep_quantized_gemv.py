"""Sweeps the M = 1 GEMV configurations of quantized_linear on Qwen3-8B shapes (issue 16).

Each configuration runs back to back on distinct weight copies (more than the L2 holds) from one
CUDA graph, as a model's layers run; bf16 `F.linear` and the configuration `_gemv_config` picks
are timed the same way. The best configurations per shape are what `_gemv_config` encodes.
Needs a CUDA GPU.

    python kernels-bench/sweep_quantized_gemv.py int8,fp8 [--json FILE]
    python kernels-bench/sweep_quantized_gemv.py int8,fp8 --gated   # gate_up with its activation
    python kernels-bench/sweep_quantized_gemv.py fp8 --folds 1,16 --splits 1,2   # FOLD too, fewer splits

With `--gated` it sweeps `quantized_gated_gemv` on the gate/up shape (unsplit: the activation
needs whole sums), and "default" is the unfused pair: the default GEMV, then `silu_and_mul`.
"""

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from infer.kernels import silu_and_mul
from infer.kernels.quantized_linear import _k_tile_cap, _launch
from infer.models.quantization import quantize_weight

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# Bytes of weight copies per measurement: four times an H100's 50 MB L2.
STREAMED_BYTES = 200e6
COPY_BANDWIDTH = 3.0e12  # for the "ideal" column: an H100's measured device-to-device copy


def streamed_us(calls: list[Callable[[], object]], repeats: int = 5) -> float:
    """Median µs per call of `calls` replayed back to back from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def configurations(method: str, folds: tuple[int, ...], splits: tuple[int, ...]):
    """(config, split_k) pairs: tile rows, tile columns, unroll, warps, products folded per
    thread (FOLD), K splits. fp8 tiles of up to 32 rows stay inside a 128-row scale block, so
    their columns may span 128-column blocks."""
    if method == "int8":
        grid = itertools.product([4, 8, 16, 32], [(256, 1), (512, 1), (1024, 1), (2048, 1)], [2, 4, 8])
    else:
        grid = itertools.product([8, 16, 32], [(128, 1), (128, 4), (256, 1), (512, 1), (1024, 1)], [4, 8])
    for (block_n, (block_k, unroll), warps), fold, split in itertools.product(grid, folds, splits):
        config = dict(
            BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, num_warps=warps, num_stages=1, FOLD=fold
        )
        yield config, split


def sweep_shape(
    method: str, n: int, k: int, sweep: bool, gated: bool, folds: tuple[int, ...], splits: tuple[int, ...]
) -> dict:
    block = (1, k) if method == "int8" else (128, 128)
    weights = [
        quantize_weight(torch.randn(n, k, device="cuda") * k**-0.5, method, block)
        for _ in range(max(2, int(STREAMED_BYTES // (n * k))))
    ]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    dense = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(max(2, int(STREAMED_BYTES // (2 * n * k))))
    ]
    bf16_us = streamed_us([lambda w=w: F.linear(x, w) for w in dense])
    del dense
    if gated:
        default = [lambda q=q, s=s: silu_and_mul(_launch(x, q, s, block, None)) for q, s in weights]
    else:
        default = [lambda q=q, s=s: _launch(x, q, s, block, None) for q, s in weights]
    default_us = streamed_us(default)
    activation = "silu" if gated else None
    rows = []
    for config, split in configurations(method, folds, splits) if sweep else ():
        if gated and split > 1:
            continue
        too_deep = config["BLOCK_K"] * config["UNROLL"] * split > k
        # A tile whose rows take scales of their own (int8's) stays inside one scale block.
        straddles = block[0] % config["BLOCK_N"] and config["BLOCK_K"] > _k_tile_cap(k, block[1])
        if too_deep or straddles:
            continue
        calls = [
            lambda q=q, s=s, config=config, split=split: _launch(
                x, q, s, block, None, kernel="gemv", config=config, split_k=split, activation=activation
            )
            for q, s in weights
        ]
        rows.append((streamed_us(calls), config, split))
    rows.sort(key=lambda row: row[0])
    return {
        "bf16_us": bf16_us,
        "default_us": default_us,
        "ideal_us": n * k / COPY_BANDWIDTH * 1e6,
        "best": rows[:8],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("methods", help="comma-separated: int8, fp8")
    parser.add_argument("--json", type=Path, help="write every shape's best configurations here")
    parser.add_argument("--gated", action="store_true", help="gate_up with its activation, fused")
    parser.add_argument(
        "--no-sweep", action="store_true", help="time bf16 and the default configuration only"
    )
    parser.add_argument("--folds", default="1", help="comma-separated FOLD values to sweep")
    parser.add_argument("--splits", default="1,2,4,8", help="comma-separated K splits to sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    folds, splits = (tuple(int(v) for v in arg.split(",")) for arg in (args.folds, args.splits))
    for method in args.methods.split(","):
        for name, (n, k) in SHAPES.items():
            if args.gated and name != "gate_up":
                continue
            result = results[f"{method}/{name}"] = sweep_shape(
                method, n, k, not args.no_sweep, args.gated, folds, splits
            )
            print(
                f"{method} {name} {n}x{k}: bf16 {result['bf16_us']:.1f} µs, "
                f"default {result['default_us']:.1f} µs, ideal {result['ideal_us']:.1f} µs",
                flush=True,
            )
            for us, config, split in result["best"][:3]:
                print(f"    best: {us:.1f} µs {config} split {split}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
