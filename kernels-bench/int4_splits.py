"""int4_linear's one-row GEMV with its K split 4 to 32 ways against the split its rule picks
(`_int4_gemv_splits`: up to 8, while the programs number under two an SM), for the default tile of
each Qwen3-8B shape and a few others: µs a call back to back on distinct weights from one CUDA
graph, launched with PDL as the model launches them, the best of three alternated runs. Needs a
CUDA GPU.

    python kernels-bench/int4_splits.py [--splits 4,8,16,32] [--tiles 128x128x4:1,128x256x4:1]
"""

import argparse
import functools
import importlib

import torch
from sweep_quantized_gemv import SHAPES, quantized_weights, streamed_us

# The modules, not the functions infer.kernels exports under their names.
int4_linear = importlib.import_module("infer.kernels.gemv.int4_linear")
configs = importlib.import_module("infer.kernels.gemv.configs")


def tiles_of(text: str) -> list:
    """`ROWSxCOLUMNSxWARPS:PREFETCH,...` -> [(rows, columns, warps, prefetch), ...]."""
    tiles = []
    for tile in text.split(","):
        shape, _, prefetch = tile.partition(":")
        tiles.append((*(int(v) for v in shape.split("x")), int(prefetch or 0)))
    return tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=lambda t: [int(v) for v in t.split(",")], default=[4, 8, 16, 32])
    parser.add_argument("--tiles", type=tiles_of, default=[])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = quantized_weights("int4", n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        default = configs._int4_gemv_config(n, k, 128)
        tiles = [default]
        for rows, columns, warps, prefetch in args.tiles:
            tile = dict(BLOCK_N=rows, BLOCK_K=columns, num_warps=warps, UNROLL=1, num_stages=1)
            tiles.append(tile | dict(PREFETCH=prefetch))
        for config in tiles:
            step = config["BLOCK_K"] * config["UNROLL"]
            splits = [None] + [s for s in args.splits if k % (s * step) == 0]
            times = {s: [] for s in splits}
            for _ in range(3):
                for s in splits:
                    launch = functools.partial(int4_linear._launch, x, config=config, split_k=s, pdl=True)
                    times[s].append(streamed_us([functools.partial(launch, *w[:4], None) for w in weights]))
            label = f"{config['BLOCK_N']}x{config['BLOCK_K']}, {config['num_warps']} warps"
            label += f", ahead {config['PREFETCH']}"
            cells = ", ".join(f"{'rule' if s is None else s}: {min(times[s]):.2f}" for s in splits)
            print(f"{name} {label}: {cells} us", flush=True)


if __name__ == "__main__":
    main()
