"""int4_linear (w4a16) against bf16 and the 8-bit formats, on Qwen3-8B's four projections.

For each projection (fused q/k/v, o, fused gate/up, down) at 1, 16 and 512 rows of x (bf16), one
run times side by side:

- `w4a16_int4_g128`: `int4_linear`, groups of 128 columns with bf16 scales and zero points
  (what a GPTQ or AWQ checkpoint becomes);
- `w8a16_int8_channel` and `w8a16_fp8_128x128`: `quantized_linear` (per-channel int8, fp8 with
  128 x 128 block scales), as bench_quantized_linear.py times them;
- `linear_bf16`: cuBLAS `F.linear` on the bf16 weight, the unquantized model;
- `gemv_bf16` (one row only): our dense GEMV, which the bf16 model runs at batch 1.

bytes_moved is the weight in its format (half a byte a weight for int4, one for 8 bits, two for
bf16), its scales and zero points, x and y: at one row the weight is nearly all of it, so GB/s
over the copy bandwidth measured in the same run (the "roofline" column) says how close each
kernel is to its ceiling. Each is timed two ways: `harness.time_ms` (L2 flushed before each call)
and `streamed_us` (back-to-back calls on distinct weights from a CUDA graph, as a model's layers
run; bench_quantized_linear's). The eager int4 column is `dequantize_int4` then cuBLAS.

    python kernels-bench/bench_int4_linear.py [--out FILE.md] [--tokens 1,16,512]

needs a CUDA GPU; under pytest (kernels-bench/conftest.py) its cases join the other benchmarks.
"""

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bench_quantized_linear import FORMATS, quantized_inputs, streamed_us
from harness import DTYPE, IMPLS, Case, copy_bandwidth_gbps, environment_header, gpu_tensor, time_ms

from infer.kernels import dequantize_int4, gemv, int4_linear, pack_int4, quantized_linear

TOKENS = [1, 16, 512]
# (name, N, K): fused q/k/v, o, fused gate/up, down.
SHAPES = [
    ("qwen3-8b qkv", 6144, 4096),
    ("qwen3-8b o", 4096, 4096),
    ("qwen3-8b gate_up", 24576, 4096),
    ("qwen3-8b down", 4096, 12288),
]
GROUP_SIZE = 128
# Columns of the comparison table, in order: (op, label).
OPS = [
    ("w4a16_int4_g128", "int4"),
    ("w8a16_int8_channel", "int8"),
    ("w8a16_fp8_128x128", "fp8"),
    ("linear_bf16", "bf16 cuBLAS"),
    ("gemv_bf16", "bf16 gemv"),
]


def int4_inputs(tokens, N, K):
    """x, and a 4-bit weight with scales and zeros such that |W| ~ 1/sqrt(K)."""
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device="cuda")
    groups = (N, K // GROUP_SIZE)
    scales = (torch.rand(groups, device="cuda") / (5 * math.sqrt(K))).to(DTYPE)
    zeros = torch.randint(0, 16, groups, dtype=torch.uint8, device="cuda")
    return gpu_tensor(tokens, K), pack_int4(q), scales, zeros, GROUP_SIZE


def int4_bytes(N, K):
    return N * K // 2 + N * (K // GROUP_SIZE) * (DTYPE.itemsize + 1)  # packed weight, scales, zeros


def dequantize_int4_and_matmul(x, qweight, scales, zeros, group_size):
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype))


def int4_case(name, N, K, tokens) -> Case:
    return Case(
        op="w4a16_int4_g128",
        shape=f"{tokens}x{N}x{K} ({name})",
        tokens=tokens,
        bytes_moved=int4_bytes(N, K) + tokens * (N + K) * DTYPE.itemsize,  # + read x, write y
        make_inputs=lambda: int4_inputs(tokens, N, K),
        triton_fn=int4_linear,
        eager_fn=dequantize_int4_and_matmul,
    )


def cases() -> list[Case]:
    """The int4 cases alone, for run_all.py and pytest (the 8-bit ones are bench_quantized_linear's)."""
    return [int4_case(name, N, K, tokens) for name, N, K in SHAPES for tokens in TOKENS]


def comparison_cases(tokens_list) -> list[Case]:
    """Every format of OPS on each shape, for the side-by-side table (eager_fn unused)."""
    out = []
    for name, N, K in SHAPES:
        for tokens in tokens_list:
            out.append(int4_case(name, N, K, tokens))
            shape, activations = f"{tokens}x{N}x{K} ({name})", tokens * (N + K) * DTYPE.itemsize
            for op, weight_dtype, block_of in FORMATS:
                bn, bk = block_of(K)
                make = lambda t=tokens, n=N, k=K, d=weight_dtype, b=(bn, bk): quantized_inputs(t, n, k, d, b)  # noqa: E731
                scale_bytes = 4 * math.ceil(N / bn) * math.ceil(K / bk)
                out.append(
                    Case(op, shape, tokens, N * K + scale_bytes + activations, make, quantized_linear, None)
                )
            make = lambda t=tokens, n=N, k=K: (gpu_tensor(t, k), gpu_tensor(n, k))  # noqa: E731
            dense_bytes = N * K * DTYPE.itemsize + activations
            out.append(Case("linear_bf16", shape, tokens, dense_bytes, make, F.linear, None))
            if tokens == 1:
                out.append(Case("gemv_bf16", shape, tokens, dense_bytes, make, gemv, None))
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_int4_linear(bench_op, case, impl):
    bench_op(case, impl)


def weight_bytes(inputs) -> int:
    return sum(t.numel() * t.element_size() for t in inputs[1:] if isinstance(t, torch.Tensor))


def comparison_table(tokens_list) -> str:
    """One row per (projection, tokens): µs, GB/s and % of the copy bandwidth of each format."""
    copy = copy_bandwidth_gbps()
    results: dict[tuple[str, str], dict] = {}
    for case in comparison_cases(tokens_list):
        inputs = case.make_inputs()
        us = 1e3 * time_ms(case.triton_fn, inputs)
        row = dict(us=us, gbps=case.bytes_moved / (us * 1e-6) / 1e9)
        if case.op == "w4a16_int4_g128":
            row["eager_us"] = 1e3 * time_ms(case.eager_fn, inputs)
        row["streamed_us"] = streamed_us(case.triton_fn, case.make_inputs, weight_bytes(inputs))
        row["streamed_gbps"] = case.bytes_moved / (row["streamed_us"] * 1e-6) / 1e9
        del inputs
        torch.cuda.empty_cache()
        results[(case.shape, case.op)] = row
        print(case.id, row, flush=True)
    header = "| tokens x N x K | " + " | ".join(
        f"{label} us / GB/s / % of copy (streamed)" for _, label in OPS
    )
    rows = [
        header + " | int4 x the faster bf16 (streamed) | int4 eager us |",
        "|---|" + "---:|" * (len(OPS) + 2),
    ]
    for shape in dict.fromkeys(shape for shape, _ in results):
        cells = []
        for op, _ in OPS:
            r = results.get((shape, op))
            cells.append(
                "-"
                if r is None
                else f"{r['us']:.1f} / {r['gbps']:.0f} / {100 * r['gbps'] / copy:.0f}% "
                f"({r['streamed_us']:.1f} / {100 * r['streamed_gbps'] / copy:.0f}%)"
            )
        int4 = results[(shape, "w4a16_int4_g128")]
        bf16 = [results[key] for key in ((shape, "linear_bf16"), (shape, "gemv_bf16")) if key in results]
        best, best_streamed = min(r["us"] for r in bf16), min(r["streamed_us"] for r in bf16)
        ratio = f"{best / int4['us']:.2f} ({best_streamed / int4['streamed_us']:.2f})"
        rows.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio} | {int4['eager_us']:.0f} |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="markdown file to write as well")
    parser.add_argument(
        "--tokens",
        type=lambda s: [int(t) for t in s.split(",")],
        default=TOKENS,
        help="rows of x, comma-separated (default: 1,16,512)",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel benchmarks need a CUDA GPU")
    text = f"{environment_header()}\n\n{comparison_table(args.tokens)}\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
