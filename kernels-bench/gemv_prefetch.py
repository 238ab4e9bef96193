"""int4_linear's one-row GEMV with each weight tile loaded a step before it is summed (PREFETCH 1),
with x loaded a step ahead too (2), and with neither (0), on Qwen3-8B's shapes for a few tiles;
then its gate|up with the activation fused (`int4_gated_gemv`, K unsplit) against the split GEMV
and `silu_and_mul` after it. µs a call back to back on distinct weights from one CUDA graph,
launched with PDL as the model launches them (the best of three alternated runs). Needs a CUDA GPU.

    python kernels-bench/gemv_prefetch.py [--tiles 32x256x4,128x256x8] [--gated-tiles 16x256x4]

(`--tiles`: rows x columns x warps, in place of the default list.)
"""

import argparse
import functools
import importlib

import torch
from sweep_quantized_gemv import SHAPES, quantized_weights, streamed_us

# The module, not the function infer.kernels exports under its name.
int4_linear = importlib.import_module("infer.kernels.gemv.int4_linear")
silu_and_mul = importlib.import_module("infer.kernels").silu_and_mul

# (rows, columns, warps) a tile; None: the default for the shape.
TILES = [None, (128, 128, 8), (64, 256, 4), (256, 128, 8), (64, 128, 4)]
GATED_TILES = [None, (64, 256, 4), (32, 256, 4), (64, 128, 8), (128, 128, 8)]


def config_of(tile, prefetch):
    if tile is None:
        return None
    rows, columns, warps = tile
    return dict(BLOCK_N=rows, BLOCK_K=columns, num_warps=warps, UNROLL=1, num_stages=1, PREFETCH=prefetch)


def label_of(tile) -> str:
    return "default" if tile is None else f"{tile[0]}x{tile[1]}, {tile[2]} warps"


def tiles_of(text: str) -> list:
    return [tuple(int(v) for v in tile.split("x")) for tile in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=tiles_of, default=TILES[1:])
    parser.add_argument("--gated-tiles", type=tiles_of, default=GATED_TILES[1:])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    totals = {}
    for name, (n, k) in SHAPES.items():
        weights = quantized_weights("int4", n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for tile in [None, *args.tiles]:
            choices = [None] if tile is None else [0, 1, 2]
            times = {p: [] for p in choices}
            for _ in range(3):
                for p in choices:
                    launch = functools.partial(int4_linear._launch, x, config=config_of(tile, p), pdl=True)
                    times[p].append(streamed_us([functools.partial(launch, *w[:4], None) for w in weights]))
            for p in choices:
                totals[(label_of(tile), p)] = totals.get((label_of(tile), p), 0.0) + min(times[p])
            cells = ", ".join(f"prefetch {p}: {min(times[p]):.2f}" for p in choices)
            print(f"{name} {label_of(tile)}: {cells} us", flush=True)
    for (label, p), us in sorted(totals.items(), key=lambda item: item[1]):
        print(f"the four, {label}, prefetch {p}: {us:.2f} us", flush=True)

    n, k = SHAPES["gate_up"]
    weights = quantized_weights("int4", n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def unfused(w):
        return silu_and_mul(int4_linear._launch(x, *w, None, pdl=True))

    def fused(w, config):
        return int4_linear._launch(x, *w, None, config=config, activation="silu", pdl=True)

    us = min(streamed_us([functools.partial(unfused, w) for w in weights]) for _ in range(3))
    print(f"gate_up, the split GEMV (default tiles) + silu_and_mul: {us:.2f} us", flush=True)
    expected = unfused(weights[0]).float()
    for tile in [None, *args.gated_tiles]:
        for p in [None] if tile is None else [0, 1]:
            config = config_of(tile, p)
            error = (fused(weights[0], config).float() - expected).abs().max().item()
            us = min(streamed_us([functools.partial(fused, w, config) for w in weights]) for _ in range(3))
            print(f"gate_up fused, {label_of(tile)}, prefetch {p}: {us:.2f} us; difference {error:.3g}")


if __name__ == "__main__":
    main()
