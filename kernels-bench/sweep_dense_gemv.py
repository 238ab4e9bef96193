"""Sweeps the M = 1 GEMV of quantized_linear run on dense bf16 weights (`infer.kernels.gemv`)
against cuBLAS's `F.linear`, on the 1-2B models' projections (issue 15).

Each configuration runs back to back on distinct weight copies (more than the L2 holds) from one
CUDA graph, as a model's layers run (`streamed_us`); the best six are timed again under
programmatic dependent launch. `_dense_gemv_config` encodes what this found
(docs/benchmarks/generation.md#one-row-gemv). Needs a CUDA GPU.

    python kernels-bench/sweep_dense_gemv.py [--lm-heads | --focused]

`--focused` times a short list of tiles (`FOCUSED`: two-row tiles, 2048 columns, software
pipelining, K splits) on the shapes where `_dense_gemv_config` departs from 4 x 1024, each
plain and under PDL, and prints the eight fastest under PDL; then the gate|up projections as
`gated_gemv` runs them (GeLU, unsplit) under `FOCUSED_GATED`'s tiles.
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
from sweep_quantized_gemv import streamed_us

from infer.kernels.gemv.configs import _dense_gemv_config
from infer.kernels.gemv.dense import _launch

PROJECTIONS = {
    "gemma qkv": (1536, 1152),
    "gemma o": (1152, 1024),
    "gemma gate_up": (13824, 1152),
    "gemma down": (1152, 6912),
    "llama qkv": (3072, 2048),
    "llama and qwen o": (2048, 2048),
    "llama gate_up": (16384, 2048),
    "llama down": (2048, 8192),
    "qwen qkv": (4096, 2048),
    "qwen gate_up": (12288, 2048),
    "qwen down": (2048, 6144),
}
LM_HEADS = {"gemma lm_head": (262144, 1152), "llama lm_head": (128256, 2048), "qwen lm_head": (151936, 2048)}
# (rows, columns, warps, stages, K splits) for --focused.
FOCUSED = [
    (4, 1024, 8, 1, 1), (4, 1024, 8, 2, 1), (4, 1024, 8, 3, 1), (2, 1024, 4, 1, 1), (2, 1024, 4, 3, 1),
    (2, 2048, 8, 1, 1), (4, 2048, 8, 1, 1), (8, 1024, 8, 1, 1), (8, 512, 4, 1, 1), (8, 512, 4, 3, 1),
    (4, 512, 4, 1, 1), (4, 512, 4, 3, 1), (2, 512, 2, 1, 1), (1, 1024, 4, 1, 1), (1, 2048, 8, 1, 1),
    (16, 256, 4, 1, 1), (16, 256, 4, 3, 1), (4, 1024, 8, 1, 2), (8, 1024, 8, 1, 2), (8, 256, 2, 1, 1),
    (8, 256, 2, 3, 1), (16, 512, 8, 1, 1), (32, 256, 8, 1, 1),
]  # fmt: skip
FOCUSED_SHAPES = ("gemma down", "qwen down", "llama down", "gemma o", "gemma qkv")
# The gated GEMV's tiles: 8 x 256 with 2 warps (as shipped) needs 129 registers a thread, with
# 4 warps 70 (ptxas, sm_90, Triton 3.9.0, offline with the JIT's divisibility by 16).
FOCUSED_GATED = [
    (8, 256, 2, 1, 1), (8, 256, 4, 1, 1), (8, 128, 2, 1, 1), (4, 256, 2, 1, 1), (4, 512, 4, 1, 1),
    (8, 512, 4, 1, 1), (16, 256, 4, 1, 1), (16, 256, 8, 1, 1), (4, 1024, 8, 1, 1), (8, 1024, 8, 1, 1),
    (2, 2048, 8, 1, 1), (4, 2048, 8, 1, 1), (8, 256, 4, 3, 1), (8, 128, 2, 3, 1),
]  # fmt: skip
FOCUSED_GATED_SHAPES = ("gemma gate_up", "qwen gate_up", "llama gate_up")
STREAMED_BYTES = 200e6  # weight copies per measurement: four times an H100's 50 MB L2
FOCUSED_STREAMED_BYTES = 300e6  # as --focused measured on the H200 (2026-11-28, 7f1a445)
COPY_BANDWIDTH = 3.0e12  # for the "ideal" column: an H100's measured device-to-device copy


def configurations(lm_heads: bool) -> list[tuple[dict, int]]:
    """(config, K splits) pairs; an LM head's 2^17-2^18 rows need 8 rows a tile at least (a grid
    dimension holds 65535 programs) and leave no SM idle unsplit."""
    if lm_heads:
        grid = itertools.product([8, 16, 32, 64], [256, 512, 1024], [2, 4, 8], [1])
    else:
        grid = itertools.product([4, 8, 16, 32], [256, 512, 1024], [2, 4, 8], [1, 2, 4, 8])
    return [
        (dict(BLOCK_N=bn, BLOCK_K=bk, UNROLL=1, num_warps=w, num_stages=1), split)
        for bn, bk, w, split in grid
    ]


def streamed_gemv(n: int, k: int, streamed_bytes: float, activation: str | None = None):
    """(x, the weight copies, `calls`): `calls(config, split)` lists one GEMV (the gated one with
    `activation`) of x by each of at least four `[n, k]` bf16 copies, `streamed_bytes` in all."""
    copies = max(4, int(streamed_bytes // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def calls(config=None, split=None, pdl=False):
        return [
            lambda w=w: _launch(x, w, None, config=config, split_k=split, activation=activation, pdl=pdl)
            for w in weights
        ]

    return x, weights, calls


def sweep_shape(n: int, k: int, configs: list[tuple[dict, int]]) -> None:
    x, weights, calls = streamed_gemv(n, k, STREAMED_BYTES)
    cublas = streamed_us([lambda w=w: F.linear(x, w) for w in weights])
    default = streamed_us(calls())
    rows = sorted(
        (streamed_us(calls(config, split)), config, split)
        for config, split in configs
        if config["BLOCK_K"] * split <= k
    )
    pdl_rows = sorted(
        (streamed_us(calls(config, split, pdl=True)), config, split) for _, config, split in rows[:6]
    )

    def name(row):
        us, config, split = row
        return (
            f"{us:.2f} ({config['BLOCK_N']}x{config['BLOCK_K']}, {config['num_warps']} warps, split {split})"
        )

    print(
        f"{n}x{k}: cuBLAS {cublas:.2f} | default config {default:.2f} | best {name(rows[0])} | "
        f"best under PDL {name(pdl_rows[0])} | "
        f"weight bytes at 3.0 TB/s {2 * n * k / COPY_BANDWIDTH * 1e6:.2f}",
        flush=True,
    )


def sweep_focused(label: str, n: int, k: int, activation: str | None = None) -> None:
    """FOCUSED's tiles on one shape (FOCUSED_GATED's for a gate|up weight through the gated GEMV
    with `activation`), plain and under PDL; the eight fastest under PDL."""
    _, _, calls = streamed_gemv(n, k, FOCUSED_STREAMED_BYTES, activation)
    rows = []
    for bn, bk, warps, stages, split in FOCUSED_GATED if activation else FOCUSED:
        if label.endswith("lm_head") and bn < 8:
            continue  # 2^17-2^18 rows need 8 a tile (a grid dimension holds 65535 programs)
        bk = min(bk, triton.next_power_of_2(k))
        config = dict(BLOCK_N=bn, BLOCK_K=bk, UNROLL=1, num_warps=warps, num_stages=stages)
        plain = streamed_us(calls(config, split))
        pdl = streamed_us(calls(config, split, pdl=True))
        rows.append((pdl, plain, f"{bn}x{bk}, {warps} warps, {stages} stages, split {split}"))
    default = streamed_us(calls(pdl=True))
    print(f"\n{label} {n}x{k}: {_dense_gemv_config(n, k)} under PDL {default:.2f} us")
    for pdl, plain, name in sorted(rows)[:8]:
        print(f"  {name}: {pdl:.2f} us under PDL, {plain:.2f} plain")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lm-heads", action="store_true", help="the three LM heads instead of the projections"
    )
    parser.add_argument(
        "--focused", action="store_true", help="FOCUSED's tiles on FOCUSED_SHAPES and gemma's LM head"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.focused:
        shapes = {name: PROJECTIONS[name] for name in FOCUSED_SHAPES} | {
            "gemma lm_head": LM_HEADS["gemma lm_head"]
        }
        for label, (n, k) in shapes.items():
            sweep_focused(label, n, k)
            torch.cuda.empty_cache()
        for label in FOCUSED_GATED_SHAPES:
            sweep_focused(label, *PROJECTIONS[label], activation="gelu_tanh")
            torch.cuda.empty_cache()
        return
    shapes = LM_HEADS if args.lm_heads else PROJECTIONS
    configs = configurations(args.lm_heads)
    for label, (n, k) in shapes.items():
        print(f"{label}: ", end="")
        sweep_shape(n, k, configs)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
