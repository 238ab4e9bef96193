"""gguf_gemv_cpu.c's one-row variants (AVX2, AVX-512 VNNI where the CPU has it) alternated in one
process, on SmolLM2-135M's Linear shapes, each streamed over distinct random weights (48 MB a
shape, more than the caches hold, as a decode step streams them):

    python kernels-bench/gguf_gemv_cpu_variants.py --threads 1

Printed per format and shape: the 3rd best of --repeats passes a variant, and the products of a
token (30 x q|k|v, o, gate|up, down, plus the LM head, all in the one format).
"""

import argparse
import time

import torch

from infer.kernels import GGUF_FORMATS, gguf_cpu_variants, use_gguf_cpu_variant
from infer.kernels.cpu.gguf_linear import _GGUF_GEMV
from infer.kernels.cpu.native import native_function

SHAPES = {
    "q|k|v": (960, 576),
    "o": (576, 576),
    "gate|up": (3072, 576),
    "down": (576, 1536),
    "LM head": (49152, 576),
}
LAYERS = 30
STREAMED_BYTES = 48e6


def random_blocks(n: int, k: int, block_bytes: int) -> torch.Tensor:
    """Random quants under an fp16 scale of about 0.01 (0x211F) in every block."""
    weight = torch.randint(0, 256, (n, k // 32 * block_bytes), dtype=torch.uint8)
    weight.view(n, -1, block_bytes)[:, :, 0:2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8)
    return weight


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--formats", default="q4_1,q8_0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gemv, variants = native_function(*_GGUF_GEMV), gguf_cpu_variants()
    assert gemv is not None, "the C kernels do not build here"
    for fmt in args.formats.split(","):
        type_id, block_bytes = GGUF_FORMATS[fmt]
        per_token = dict.fromkeys(variants, 0.0)
        for name, (n, k) in SHAPES.items():
            weights = [
                random_blocks(n, k, block_bytes) for _ in range(max(2, int(STREAMED_BYTES // (n * k))))
            ]
            x, out = torch.randn(1, k), torch.empty(1, n)
            times = {variant: [] for variant in variants}
            for _ in range(args.repeats):
                for variant in variants:
                    use_gguf_cpu_variant(variant)
                    start = time.perf_counter()
                    for w in weights:
                        gemv(type_id, x.data_ptr(), w.data_ptr(), out.data_ptr(), 1, n, k, args.threads)
                    times[variant].append((time.perf_counter() - start) / len(weights) * 1e6)
            use_gguf_cpu_variant(None)
            for variant in variants:
                per_token[variant] += sorted(times[variant])[2] * (1 if name == "LM head" else LAYERS)
            print(fmt, name, ", ".join(f"{v} {sorted(times[v])[2]:.1f} us" for v in variants), flush=True)
        print(fmt, "a token:", ", ".join(f"{v} {t / 1e3:.2f} ms" for v, t in per_token.items()))


if __name__ == "__main__":
    main()
