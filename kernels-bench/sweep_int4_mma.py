"""Sweeps gemv.int4_mma's tiles (BLOCK_N rows and WARPS warps a program) and K splits on Qwen3-8B's
one-row int4 products, gate|up with its activation too, without PDL and with it: the choices of
`_INT4_MMA_*` and `_int4_mma_splits` (gemv.configs). Each configuration's output is checked
against the reference first, then timed as sweep_quantized_gemv times it (back to back on distinct
weights from one CUDA graph, more bytes than the L2 holds). Needs a CUDA GPU and Gluon.

    python kernels-bench/sweep_int4_mma.py [--json FILE]
"""

import argparse
import functools
import json
from pathlib import Path

import torch
from sweep_quantized_gemv import INT4_GROUP_SIZE, SHAPES, quantized_weights, streamed_us

from infer.kernels import int4_gated_gemv_ref, int4_linear_ref
from infer.kernels.gemv.int4_linear import _launch

# (BLOCK_N, WARPS): 16 rows a warp's MMA tile, up to 2 of them a warp.
TILES = [(32, 2), (64, 4), (128, 4), (128, 8), (256, 8)]
SPLITS = [1, 2, 4, 8, 16]
# Programs an SM outside which a configuration is not tried.
PROGRAMS_PER_SM = (1, 16)
# The products a decode layer runs, gate|up last with its activation (the model's form).
PRODUCTS = [(name, None) for name in SHAPES] + [("gate_up", "silu")]


def checked(x, weight, activation, **launch) -> bool:
    """Whether `_launch`'s output with `launch`'s overrides is the reference's (within 1% of the
    largest output: fp32 sums in another order)."""
    out = _launch(x, *weight[:4], None, activation=activation, **launch).float()
    reference = (
        int4_linear_ref
        if activation is None
        else functools.partial(int4_gated_gemv_ref, activation=activation)
    )
    expected = reference(x, *weight[:4], None).float()
    return bool((out - expected).abs().max() <= 0.01 * expected.abs().max())


def sweep_product(name: str, activation: str | None) -> list[dict]:
    """Every tile and split of one product, and the default, each without PDL and with it."""
    n, k = SHAPES[name]
    weights = quantized_weights("int4", n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    groups = k // INT4_GROUP_SIZE
    rows = []
    for pdl in (False, True):
        choices = [({}, "default")]
        for (block_n, warps), split in ((tile, split) for tile in TILES for split in SPLITS):
            programs = -(-(n // 2 if activation else n) // (block_n // 2 if activation else block_n)) * split
            sms = torch.cuda.get_device_properties().multi_processor_count
            within = PROGRAMS_PER_SM[0] * sms <= programs <= PROGRAMS_PER_SM[1] * sms
            if within and groups % (2 * split) == 0:  # whole steps of 2 groups
                config = {"BLOCK_N": block_n, "WARPS": warps}
                choices.append(
                    ({"kernel": "mma", "config": config, "split_k": split}, f"{block_n}x{warps} /{split}")
                )
        for launch, label in choices:
            launch = {**launch, "pdl": pdl}
            if not checked(x, weights[0], activation, **launch):
                raise AssertionError(f"{name} {label}: not the reference's output")
            call = functools.partial(_launch, x, activation=activation, **launch)
            us = streamed_us([functools.partial(call, *w[:4], None) for w in weights])
            rows.append({"product": name, "activation": activation, "pdl": pdl, "label": label, "us": us})
        best = sorted((r for r in rows if r["pdl"] == pdl), key=lambda r: r["us"])[:3]
        default = next(r["us"] for r in rows if r["pdl"] == pdl and r["label"] == "default")
        title = name if activation is None else f"{name} with {activation}"
        print(
            f"{title} pdl={pdl}: default {default:.2f} µs; best",
            [(r["label"], round(r["us"], 2)) for r in best],
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write every configuration's time here")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = [row for product in PRODUCTS for row in sweep_product(*product)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
