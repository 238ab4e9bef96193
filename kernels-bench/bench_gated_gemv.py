"""The gated GEMV (`gated_gemv`: a gated MLP's gate/up projection and its activation in one
kernel) against the two kernels it replaces (`gemv`, then `silu_and_mul`), on the 1-2B models'
gate/up weights, batch-1 decode; and infer.kernels.argmax against torch.argmax on vocabularies'
rows. Each call runs back to back from one CUDA graph (`streamed_us`), the GEMVs over distinct
weight copies (more than the L2 holds), with and without programmatic dependent launch. Needs a
CUDA GPU.

    python kernels-bench/bench_gated_gemv.py [--sweep]

`--sweep` times the gated GEMV alone over a grid of tiles, under PDL.
"""

import argparse
import itertools

import torch
from sweep_quantized_gemv import streamed_us

from infer.kernels import argmax, gemv, silu_and_mul
from infer.kernels.gemv.configs import _dense_gemv_config
from infer.kernels.gemv.dense import _launch

GATE_UP = {"gemma": (13824, 1152), "llama": (16384, 2048), "qwen": (12288, 2048)}
VOCABULARIES = {"smollm2": 49152, "llama": 128256, "qwen": 151936, "gemma": 262144}
STREAMED_BYTES = 200e6


def gated_gemv_shape(label: str, n: int, k: int) -> None:
    copies = max(4, int(STREAMED_BYTES // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    whole_tiles = _dense_gemv_config(n, k)  # as many gate rows a tile as the plain GEMV's rows
    variants = {
        "gemv + silu_and_mul": lambda w, pdl: silu_and_mul(gemv(x, w, pdl=pdl), pdl=pdl),
        "gated (default tiles)": lambda w, pdl: _launch(x, w, None, activation="silu", pdl=pdl),
        "gated (plain GEMV's tiles)": lambda w, pdl: _launch(
            x, w, None, activation="silu", config=whole_tiles, pdl=pdl
        ),
    }
    for pdl in (False, True):
        times = {
            name: streamed_us([lambda w=w, f=f, pdl=pdl: f(w, pdl) for w in weights])
            for name, f in variants.items()
        }
        results = " | ".join(f"{name} {us:.2f} µs" for name, us in times.items())
        print(f"{label} gate_up {n}x{k}, PDL {pdl}: {results}", flush=True)


def sweep_gated_shape(label: str, n: int, k: int) -> None:
    copies = max(4, int(STREAMED_BYTES // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    for block_n, block_k, warps in itertools.product([4, 8, 16], [256, 512], [2, 4]):
        config = dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=1, num_warps=warps, num_stages=1)
        calls = [
            lambda w=w, c=config: _launch(x, w, None, activation="silu", config=c, pdl=True) for w in weights
        ]
        rows.append((streamed_us(calls), f"{block_n}x{block_k}, {warps} warps"))
    best = ", ".join(f"{us:.2f} µs ({name})" for us, name in sorted(rows)[:4])
    print(f"{label} gate_up {n}x{k} gated, PDL, best: {best}", flush=True)


def argmax_shape(label: str, vocab: int, rows: int) -> None:
    logits = torch.randn(rows, vocab, device="cuda")
    ours = streamed_us([lambda: argmax(logits)] * 20)
    theirs = streamed_us([lambda: torch.argmax(logits, dim=-1)] * 20)
    print(f"argmax {label} ({vocab}) x {rows} rows: torch {theirs:.2f} µs | ours {ours:.2f} µs", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="sweep the gated GEMV's tiles instead")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.sweep:
        for label, (n, k) in GATE_UP.items():
            sweep_gated_shape(label, n, k)
            torch.cuda.empty_cache()
        return
    for label, (n, k) in GATE_UP.items():
        gated_gemv_shape(label, n, k)
        torch.cuda.empty_cache()
    for label, vocab in VOCABULARIES.items():
        for rows in (1, 8, 64, 256):
            argmax_shape(label, vocab, rows)


if __name__ == "__main__":
    main()
