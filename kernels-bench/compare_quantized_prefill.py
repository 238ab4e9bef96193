"""Prefill rows through quantized_linear's two paths on Qwen3-8B shapes (issue 16): the
tensor-core kernel against the weight dequantized in one Triton pass and multiplied by cuBLAS,
with bf16 cuBLAS beside them. Times in µs, `triton.testing.do_bench` (L2 flushed); the row count
from which the second wins is `_DEQUANTIZE_MIN_M`. Needs a CUDA GPU.

    python kernels-bench/compare_quantized_prefill.py
"""

import torch
import torch.nn.functional as F
import triton.testing

from infer.kernels.gemv.quantized import _launch
from infer.models.quantization import quantize_weight

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (64, 128, 256, 512, 1024, 2048)


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def compare(rows: int, k: int, weight, scale, block, dense) -> str:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    dot = time_us(lambda: _launch(x, weight, scale, block, None, kernel="dot"))
    dequantize = time_us(lambda: _launch(x, weight, scale, block, None, kernel="dequantize"))
    bf16 = time_us(lambda: F.linear(x, dense))
    return f"M={rows}: dot {dot:.0f} deq {dequantize:.0f} bf16 {bf16:.0f}"


def main() -> None:
    torch.manual_seed(0)
    for method in ("int8", "fp8"):
        for name, (n, k) in SHAPES.items():
            block = (1, k) if method == "int8" else (128, 128)
            weight, scale = quantize_weight(torch.randn(n, k, device="cuda") * k**-0.5, method, block)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            cells = [compare(rows, k, weight, scale, block, dense) for rows in ROWS]
            print(method, name, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
