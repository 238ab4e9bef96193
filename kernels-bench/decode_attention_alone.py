"""Decode attention alone at batch 1, per model shape (issue 15): µs a call, replayed from one
CUDA graph over 8 layers' caches, with a 64 MB write between calls so that K/V come from HBM, as
in a decode step whose weights stream through the L2. The write's own time, measured alone, is
subtracted. `--tune` also tries other warps, stages, key tiles and split counts of the decode
kernel, by setting the module's constants (docs/benchmarks/generation.md#decode-attention).
Needs a CUDA GPU.

    python kernels-bench/decode_attention_alone.py [--tune]
"""

import argparse
import importlib

import torch
from sweep_quantized_gemv import streamed_us

from infer.kernels import paged_attention

# (query heads, KV heads, head_dim, sliding window) of the 1-2B models.
SHAPES = {"llama-3.2-1b": (32, 8, 64, None), "qwen3-1.7b": (16, 8, 128, None), "gemma-3-1b": (4, 1, 256, 512)}
BLOCK_SIZE, LAYERS = 16, 8
# The module (infer.kernels exports a function under its package's name).
module = importlib.import_module("infer.kernels.paged_attention.decode")
# At batch 1 every shape's grid is one wave: the split kernel's warps are _ONE_WAVE_DECODE_WARPS.
DEFAULTS = {
    "_ONE_WAVE_DECODE_WARPS": module._ONE_WAVE_DECODE_WARPS,
    "_DECODE_STAGES": module._DECODE_STAGES,
    "_DECODE_BLOCK_N": module._DECODE_BLOCK_N,
    "_DECODE_NATIVE_QK": module._DECODE_NATIVE_QK,
}
VARIANTS = (
    [{}]
    + [
        {"_ONE_WAVE_DECODE_WARPS": w, "_DECODE_STAGES": s}
        for w in (2, 4, 8)
        for s in (1, 2, 3)
        if (w, s) != (DEFAULTS["_ONE_WAVE_DECODE_WARPS"], DEFAULTS["_DECODE_STAGES"])
    ]
    + [{"_DECODE_BLOCK_N": b} for b in (32, 128)]
    + [{"splits": n} for n in (4, 8, 32)]
    + [{"_DECODE_NATIVE_QK": not DEFAULTS["_DECODE_NATIVE_QK"]}]
)


def attention_us(shape: tuple, seq_len: int, max_seq_len: int, flush: torch.Tensor) -> float:
    num_q_heads, num_kv_heads, head_dim, window = shape
    num_blocks = max_seq_len // BLOCK_SIZE
    caches = [
        tuple(
            torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        for _ in range(LAYERS)
    ]
    q = torch.randn(1, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[None]
    seq_lens = torch.tensor([seq_len], device="cuda", dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1], device="cuda", dtype=torch.int32)

    def call(k, v):
        return lambda: paged_attention(
            q, k, v, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=table,
            num_decode_rows=1, max_query_len=1, max_seq_len=max_seq_len, scale=head_dim**-0.5,
            sliding_window=window, out=out,
        )  # fmt: skip

    calls = []
    for k, v in caches:
        calls += [lambda: flush.fill_(1), call(k, v)]
    pair = 2 * streamed_us(calls, repeats=7)  # a write and an attention
    write = streamed_us([lambda: flush.fill_(1)] * 16, repeats=7)
    return pair - write


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tune", action="store_true", help="also the other launch settings (max_seq_len 4096)"
    )
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    default_splits = module.decode_num_splits
    for name in args.models:
        shape = SHAPES[name]
        for variant in VARIANTS if args.tune else [{}]:
            for constant, value in DEFAULTS.items():
                setattr(module, constant, variant.get(constant, value))
            module.decode_num_splits = (
                (lambda *_, n=variant["splits"]: n) if "splits" in variant else default_splits
            )
            for seq_len in (384, 1024):
                for max_seq_len in (4096,) if args.tune else (1024, 4096):
                    us = attention_us(shape, seq_len, max_seq_len, flush)
                    label = variant or "as shipped"
                    print(f"{name} {label} seq_len {seq_len} max_seq_len {max_seq_len}: {us:.2f} µs")
    for constant, value in DEFAULTS.items():
        setattr(module, constant, value)
    module.decode_num_splits = default_splits


if __name__ == "__main__":
    main()
