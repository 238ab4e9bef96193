"""A decode token's weight products on the CPU, from weights where torch's allocator put them (4 KB
pages) and from their copies in transparent huge pages (`move_to_huge_pages`, what the engine does
at start-up with use_huge_pages), alternated in one process:

    python kernels-bench/cpu_huge_pages.py --threads 2 --repeats 30

The token: SmolLM2-135M's 30 x (q|k|v, o, gate|up, down) plus its LM head, random bf16 weights,
one row of x, through bf16_gemv_cpu.c (the decoder stack's bf16 product). Printed: the median and
best of --repeats passes a side, each pass alternating the two, the weights' GB/s at the median,
and the pass-by-pass ratio.
"""

import argparse
import statistics
import time

import torch
from torch import nn

from infer.kernels.cpu.bf16_linear import _BF16_GEMV
from infer.kernels.cpu.native import native_function
from infer.models.huge_pages import huge_pages_unavailable, move_to_huge_pages

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if huge_pages_unavailable() is not None:
        raise SystemExit(huge_pages_unavailable())
    torch.set_num_threads(args.threads)
    gemv = native_function(*_BF16_GEMV)
    assert gemv is not None, "the C kernels do not build here"
    shapes = LAYER * 30 + [LM_HEAD]
    plain = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    moved = nn.ParameterList(nn.Parameter(w.clone(), requires_grad=False) for w in plain)
    move_to_huge_pages(moved)
    total = sum(w.numel() * w.element_size() for w in plain)
    x = {k: torch.randn(1, k) for _, k in shapes}
    out = {n: torch.empty(1, n) for n, _ in shapes}

    def token_ms(weights) -> float:
        started = time.perf_counter()
        for w in weights:
            n, k = w.shape
            gemv(x[k].data_ptr(), w.data_ptr(), out[n].data_ptr(), 1, n, k, args.threads)
        return (time.perf_counter() - started) * 1e3

    times = {"4 KB pages": [], "huge pages": []}
    for _ in range(args.repeats):
        times["4 KB pages"].append(token_ms(plain))
        times["huge pages"].append(token_ms(list(moved)))
    print(f"torch {torch.__version__}, {args.threads} threads, bf16, {total / 1e6:.1f} MB a token")
    for side, runs in times.items():
        median = statistics.median(runs)
        print(f"{side}: median {median:.2f} ms, best {min(runs):.2f} ms, {total / median / 1e6:.1f} GB/s")
    ratios = [a / b for a, b in zip(times["huge pages"], times["4 KB pages"], strict=True)]
    print(f"huge / 4 KB, pass by pass: median {statistics.median(ratios):.3f}, faster in "
          f"{sum(r < 1 for r in ratios)} of {len(ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
