"""quantized_linear (w8a16): Triton vs eager dequantize + matmul vs torch.compile, bf16 activations.

Shapes are the projections of Qwen3-8B and Llama-3.2-3B (N x K below) at 1, 16, 256 and 2048
tokens, with int8 weights and per-channel scales (compressed-tensors) and fp8 weights with 128 x
128 block scales (Qwen3-8B-FP8). The eager implementation is what a model would run without the
kernel: dequantize the weight to bf16, then cuBLAS. Each shape also has a `linear_bf16` row,
cuBLAS `F.linear` on a bf16 weight: the unquantized model, which reads two bytes per weight.

bytes_moved is the weight (one byte each) and its scales, plus x and y: at decode the weight is
all of it, so GB/s against the copy bandwidth says how close the kernel is to its ceiling.

    python kernels-bench/bench_quantized_linear.py [--out FILE.md]

prints one row per shape and token count with the three side by side (no torch.compile), timed
two ways: `harness.time_ms` (L2 flushed before each call) and `streamed_us` (back-to-back calls
on distinct weights from a CUDA graph, as a model's layers run).
"""

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import DTYPE, IMPLS, Case, copy_bandwidth_gbps, environment_header, gpu_tensor, time_ms

from infer.kernels import dequantize_weight, quantized_linear

TOKENS = [1, 16, 256, 2048]
# (name, N, K): fused q/k/v, o, fused gate/up, down.
SHAPES = [
    ("qwen3-8b qkv", 6144, 4096),
    ("qwen3-8b o", 4096, 4096),
    ("qwen3-8b gate_up", 24576, 4096),
    ("qwen3-8b down", 4096, 12288),
    ("llama-3.2-3b qkv", 5120, 3072),
    ("llama-3.2-3b o", 3072, 3072),
    ("llama-3.2-3b gate_up", 16384, 3072),
    ("llama-3.2-3b down", 3072, 8192),
]
# (op name, weight dtype, block_size as a function of K)
FORMATS = [
    ("w8a16_int8_channel", torch.int8, lambda K: (1, K)),
    ("w8a16_fp8_128x128", torch.float8_e4m3fn, lambda K: (128, 128)),
]


def quantized_inputs(tokens, N, K, weight_dtype, block_size):
    bn, bk = block_size
    if weight_dtype == torch.int8:
        weight = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
    else:
        weight = torch.randn(N, K, device="cuda").mul(64).clamp(-448, 448).to(weight_dtype)
    scale = torch.rand(math.ceil(N / bn), math.ceil(K / bk), device="cuda") / (64 * math.sqrt(K))
    return gpu_tensor(tokens, K), weight, scale, block_size


def dequantize_and_matmul(x, weight, scale, block_size):
    return F.linear(x, dequantize_weight(weight, scale, block_size, x.dtype))


def cases() -> list[Case]:
    out = []
    for name, N, K in SHAPES:
        for tokens in TOKENS:
            activations = tokens * (N + K) * DTYPE.itemsize  # read x, write y
            for op, weight_dtype, block_of in FORMATS:
                block_size = block_of(K)
                bn, bk = block_size
                scale_bytes = 4 * math.ceil(N / bn) * math.ceil(K / bk)
                out.append(
                    Case(
                        op=op,
                        shape=f"{tokens}x{N}x{K} ({name})",
                        tokens=tokens,
                        bytes_moved=N * K + scale_bytes + activations,
                        make_inputs=lambda t=tokens, n=N, k=K, d=weight_dtype, b=block_size: quantized_inputs(
                            t, n, k, d, b
                        ),
                        triton_fn=quantized_linear,
                        eager_fn=dequantize_and_matmul,
                    )
                )
            out.append(
                Case(
                    op="linear_bf16",
                    shape=f"{tokens}x{N}x{K} ({name})",
                    tokens=tokens,
                    bytes_moved=N * K * DTYPE.itemsize + activations,
                    make_inputs=lambda t=tokens, n=N, k=K: (gpu_tensor(t, k), gpu_tensor(n, k)),
                    triton_fn=F.linear,  # cuBLAS on both sides: the baseline, not a Triton kernel
                    eager_fn=F.linear,
                )
            )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_quantized_linear(bench_op, case, impl):
    bench_op(case, impl)


def streamed_us(fn, make_inputs, weight_bytes: int) -> float:
    """Time per call with every call's weight coming from HBM, as in a model's forward pass: back
    to back on distinct copies of the inputs (several times the L2 in all), from one CUDA graph.

    `time_ms` flushes L2 by writing 256 MB before each call, and writing the dirty lines back
    then costs the timed kernel bandwidth of its own; a layer's weights in a real decode step
    evict clean lines (the previous layer's weights) instead."""
    copies = max(2, min(16, math.ceil(_STREAMED_BYTES / weight_bytes)))
    inputs = [make_inputs() for _ in range(copies)]
    for args in inputs:
        fn(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 10
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * copies)


# Weights streamed per replay in `streamed_us`: ten times an H100's 50 MB L2.
_STREAMED_BYTES = 512 * 2**20


def comparison_table() -> str:
    """One row per (shape, tokens): int8, fp8 (Triton) and bf16 cuBLAS side by side."""
    by_key: dict[tuple[str, str], dict] = {}
    for case in cases():
        inputs = case.make_inputs()
        weight_bytes = inputs[1].numel() * inputs[1].element_size()
        us = 1e3 * time_ms(case.triton_fn, inputs)
        row = by_key.setdefault((case.shape, case.op), {})
        row.update(us=us, gbps=case.bytes_moved / (us * 1e-6) / 1e9)
        if case.op != "linear_bf16":
            row["eager_us"] = 1e3 * time_ms(case.eager_fn, inputs)
        del inputs
        row["streamed_us"] = streamed_us(case.triton_fn, case.make_inputs, weight_bytes)
        torch.cuda.empty_cache()
        print(case.id, row, flush=True)
    rows = [
        "| tokens x N x K | int8 us | int8 GB/s | fp8 us | fp8 GB/s | bf16 us | bf16 GB/s "
        "| int8 x bf16 | fp8 x bf16 | streamed us int8 / fp8 / bf16 | streamed int8 x bf16 "
        "| streamed fp8 x bf16 | eager us int8 / fp8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in dict.fromkeys(shape for shape, _ in by_key):
        i8, f8, bf = (
            by_key[(shape, op)] for op in ("w8a16_int8_channel", "w8a16_fp8_128x128", "linear_bf16")
        )
        rows.append(
            f"| {shape} | {i8['us']:.1f} | {i8['gbps']:.0f} | {f8['us']:.1f} | {f8['gbps']:.0f} | "
            f"{bf['us']:.1f} | {bf['gbps']:.0f} | {bf['us'] / i8['us']:.2f} | {bf['us'] / f8['us']:.2f} | "
            f"{i8['streamed_us']:.1f} / {f8['streamed_us']:.1f} / {bf['streamed_us']:.1f} | "
            f"{bf['streamed_us'] / i8['streamed_us']:.2f} | {bf['streamed_us'] / f8['streamed_us']:.2f} | "
            f"{i8['eager_us']:.0f} / {f8['eager_us']:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="markdown file to write as well")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel benchmarks need a CUDA GPU")
    text = f"{environment_header()}\n\n{comparison_table()}\n"
    print(text)
    print(f"(copy bandwidth {copy_bandwidth_gbps():.0f} GB/s: the ceiling for every GB/s column)")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
