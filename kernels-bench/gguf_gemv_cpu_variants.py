"""gguf_gemv_cpu.c's one-row variants (AVX2, AVX-512 VNNI where the CPU has it) and weight layouts
(the file's Q8_0 and its repacked "q8_0x4") alternated in one process, on SmolLM2-135M's Linear
shapes, each streamed over distinct random weights (48 MB a shape, more than the caches hold, as a
decode step streams them):

    python kernels-bench/gguf_gemv_cpu_variants.py --threads 2 --formats q8_0,q8_0x4

Printed per shape: the 3rd best of --repeats passes a format and variant, each pass alternating
them all; then per format and variant the products of a token (30 x q|k|v, o, gate|up, down, plus
the LM head, all in the one format) and its ratio to the first format's.
"""

import argparse
import time

import torch

from infer.kernels import GGUF_FORMATS, gguf_cpu_variants, use_gguf_cpu_variant
from infer.kernels.cpu.gguf_linear import _GGUF_GEMV, GGUF_REPACKED, gguf_file_format, repack_gguf
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


def random_blocks(n: int, k: int, fmt: str) -> torch.Tensor:
    """Random quants under an fp16 scale of about 0.01 (0x211F) in every block, in `fmt`'s layout."""
    file_format = gguf_file_format(fmt)
    block_bytes = GGUF_FORMATS[file_format].block_bytes
    weight = torch.randint(0, 256, (n, k // 32 * block_bytes), dtype=torch.uint8)
    weight.view(n, -1, block_bytes)[:, :, 0:2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8)
    return repack_gguf(weight, file_format) if fmt in GGUF_REPACKED.values() else weight


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--formats", default="q4_1,q8_0,q8_0x4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gemv, variants = native_function(*_GGUF_GEMV), gguf_cpu_variants()
    assert gemv is not None, "the C kernels do not build here"
    print(f"torch {torch.__version__}, {args.threads} threads, variants {variants}", flush=True)
    formats = args.formats.split(",")
    sides = [(fmt, variant) for fmt in formats for variant in variants]
    per_token = dict.fromkeys(sides, 0.0)
    for name, (n, k) in SHAPES.items():
        count = max(2, int(STREAMED_BYTES // (n * k)))
        weights = {fmt: [random_blocks(n, k, fmt) for _ in range(count)] for fmt in formats}
        x, out = torch.randn(1, k), torch.empty(1, n)
        times = {side: [] for side in sides}
        for _ in range(args.repeats):
            for fmt, variant in sides:
                use_gguf_cpu_variant(variant)
                type_id = GGUF_FORMATS[fmt].type_id
                start = time.perf_counter()
                for w in weights[fmt]:
                    gemv(type_id, x.data_ptr(), w.data_ptr(), out.data_ptr(), 1, n, k, args.threads)
                times[fmt, variant].append((time.perf_counter() - start) / len(weights[fmt]) * 1e6)
        use_gguf_cpu_variant(None)
        for side in sides:
            per_token[side] += sorted(times[side])[2] * (1 if name == "LM head" else LAYERS)
        print(name, ", ".join(f"{f} {v} {sorted(times[f, v])[2]:.1f} us" for f, v in sides), flush=True)
    for fmt, variant in sides:
        ratio = per_token[fmt, variant] / per_token[formats[0], variant]
        print(
            f"{fmt} {variant} a token: {per_token[fmt, variant] / 1e3:.2f} ms ({ratio:.2f}x {formats[0]}'s)"
        )


if __name__ == "__main__":
    main()
