"""Sweeps the M = 1 GEMV configurations of quantized_linear (int8, fp8) and int4_linear (int4:
groups of 128 with zero points, what GPTQ and AWQ checkpoints become) on Qwen3-8B shapes.

Each configuration runs back to back on distinct weight copies (more than the L2 holds) from one
CUDA graph, as a model's layers run; bf16 `F.linear` and the configuration `_gemv_config` picks
are timed the same way. The best configurations per shape are what `_gemv_config` encodes.
Needs a CUDA GPU.

    python kernels-bench/sweep_quantized_gemv.py int8,fp8 [--json FILE]
    python kernels-bench/sweep_quantized_gemv.py int8,fp8 --gated   # gate_up with its activation
    python kernels-bench/sweep_quantized_gemv.py fp8 --folds 1,16 --splits 1,2   # FOLD too, fewer splits
    python kernels-bench/sweep_quantized_gemv.py int4 --stages 1,2   # software pipelining too

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
from harness import copy_bandwidth_gbps

from infer.kernels import pack_int4, silu_and_mul
from infer.kernels.gemv.configs import _k_tile_cap
from infer.kernels.gemv.int4_linear import _launch as int4_launch
from infer.kernels.gemv.quantized import _launch
from infer.models.quantization import quantize_weight

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# Bytes of weight copies per measurement: four times an H100's 50 MB L2.
STREAMED_BYTES = 200e6
INT4_GROUP_SIZE = 128


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


def configurations(
    method: str,
    folds: tuple[int, ...],
    splits: tuple[int, ...],
    stages: tuple[int, ...],
    grid_override: tuple | None = None,
):
    """(config, split_k) pairs: tile rows, tile columns, unroll, warps, products folded per
    thread (FOLD; 8-bit only), K splits, software pipelining stages. fp8 tiles of up to 32 rows
    stay inside a 128-row scale block, so their columns may span 128-column blocks; int4 tiles
    hold whole groups of 128 columns or one. `grid_override`: (rows, (columns, unroll) pairs,
    warps) in place of the method's grid."""
    if method == "int4":
        grid = grid_override or ([16, 32, 64, 128], [(128, 1), (256, 1), (512, 1), (1024, 1)], [2, 4, 8])
        for (block_n, (block_k, unroll), warps), stage, split in itertools.product(
            itertools.product(*grid), stages, splits
        ):
            config = dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, num_warps=warps, num_stages=stage)
            yield config, split
        return
    if grid_override:
        grid = itertools.product(*grid_override)
    elif method == "int8":
        grid = itertools.product([4, 8, 16, 32], [(256, 1), (512, 1), (1024, 1), (2048, 1)], [2, 4, 8])
    else:
        grid = itertools.product([8, 16, 32], [(128, 1), (128, 4), (256, 1), (512, 1), (1024, 1)], [4, 8])
    for (block_n, (block_k, unroll), warps), fold, split in itertools.product(grid, folds, splits):
        for stage in stages:
            config = dict(
                BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, num_warps=warps, num_stages=stage, FOLD=fold
            )
            yield config, split


def quantized_weights(method: str, n: int, k: int) -> list[tuple]:
    """Distinct copies of one shape's weight in `method`'s format, more bytes than the L2 holds:
    each the launcher's weight arguments after x."""
    count = max(2, int(STREAMED_BYTES // (n * k)))
    if method == "int4":
        groups = (n, k // INT4_GROUP_SIZE)

        def int4_weight():
            qweight = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda"))
            scales = (torch.rand(groups, device="cuda") / (5 * k**0.5)).to(torch.bfloat16)
            zeros = torch.randint(0, 16, groups, dtype=torch.uint8, device="cuda")
            return qweight, scales, zeros, INT4_GROUP_SIZE

        return [int4_weight() for _ in range(2 * count)]  # half the bytes a copy
    block = (1, k) if method == "int8" else (128, 128)
    return [
        (*quantize_weight(torch.randn(n, k, device="cuda") * k**-0.5, method, block), block)
        for _ in range(count)
    ]


def launcher(method: str) -> Callable:
    """The format's `_launch(x, *weight, bias, **overrides)`."""
    return int4_launch if method == "int4" else _launch


def sweep_shape(
    method: str,
    n: int,
    k: int,
    sweep: bool,
    gated: bool,
    folds: tuple[int, ...],
    splits: tuple[int, ...],
    stages: tuple[int, ...],
    copy_gbps: float,
    grid_override: tuple | None = None,
) -> dict:
    weights = quantized_weights(method, n, k)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights[0] if isinstance(t, torch.Tensor))
    launch = launcher(method)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    dense = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(max(2, int(STREAMED_BYTES // (2 * n * k))))
    ]
    bf16_us = streamed_us([lambda w=w: F.linear(x, w) for w in dense])
    del dense
    if gated:
        default = [lambda w=w: silu_and_mul(launch(x, *w, None)) for w in weights]
    else:
        default = [lambda w=w: launch(x, *w, None) for w in weights]
    default_us = streamed_us(default)
    activation = "silu" if gated else None
    rows = []
    for config, split in configurations(method, folds, splits, stages, grid_override) if sweep else ():
        if gated and split > 1:
            continue
        too_deep = config["BLOCK_K"] * config["UNROLL"] * split > k
        # A tile whose rows take scales of their own (int8's) stays inside one scale block.
        block = weights[0][-1]
        straddles = (
            method != "int4" and block[0] % config["BLOCK_N"] and config["BLOCK_K"] > _k_tile_cap(k, block[1])
        )
        if too_deep or straddles:
            continue
        calls = [
            lambda w=w, config=config, split=split: launch(
                x, *w, None, kernel="gemv", config=config, split_k=split, activation=activation
            )
            for w in weights
        ]
        try:
            rows.append((streamed_us(calls), config, split))
        except Exception as error:  # a configuration the compiler refuses (registers, shared memory)
            print(
                f"    skipped {config} split {split}: {type(error).__name__}: {str(error)[:120]}", flush=True
            )
    rows.sort(key=lambda row: row[0])
    return {
        "bf16_us": bf16_us,
        "default_us": default_us,
        "ideal_us": weight_bytes / (copy_gbps * 1e9) * 1e6,
        "best": rows[:8],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("methods", help="comma-separated: int8, fp8, int4")
    parser.add_argument("--json", type=Path, help="write every shape's best configurations here")
    parser.add_argument("--gated", action="store_true", help="gate_up with its activation, fused")
    parser.add_argument(
        "--no-sweep", action="store_true", help="time bf16 and the default configuration only"
    )
    parser.add_argument("--folds", default="1", help="comma-separated FOLD values to sweep")
    parser.add_argument("--splits", default="1,2,4,8", help="comma-separated K splits to sweep")
    parser.add_argument("--stages", default="1", help="comma-separated num_stages to sweep")
    parser.add_argument("--rows", help="comma-separated tile rows, in place of the method's grid")
    parser.add_argument("--columns", help="comma-separated COLUMNSxUNROLL (512x1), with --rows")
    parser.add_argument("--warps", default="4,8", help="comma-separated warps, with --rows")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    folds, splits, stages = (
        tuple(int(v) for v in arg.split(",")) for arg in (args.folds, args.splits, args.stages)
    )
    grid_override = None
    if args.rows:
        grid_override = (
            [int(v) for v in args.rows.split(",")],
            [tuple(int(p) for p in v.split("x")) for v in args.columns.split(",")],
            [int(v) for v in args.warps.split(",")],
        )
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (the ideal column: the weight's bytes at it)")
    for method in args.methods.split(","):
        for name, (n, k) in SHAPES.items():
            if args.gated and name != "gate_up":
                continue
            result = results[f"{method}/{name}"] = sweep_shape(
                method, n, k, not args.no_sweep, args.gated, folds, splits, stages, copy_gbps, grid_override
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
