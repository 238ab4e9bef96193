"""Decode attention over an fp8 KV cache against bf16, llama-3.1-8b heads (32 query, 8 KV heads of
128), 64 rows: µs a call replayed from one CUDA graph over 8 layers' caches with a 64 MB write
between calls (K/V come from HBM, as in a step), the write's own time subtracted; and store_kv of
64 tokens into each. `--variants` also times the fp8 kernel with other settings: its dots
in fp16 (paged_attention.launch._FP8_F16_DOTS), keys a loop step and pipeline stages. Needs a CUDA GPU.

    python kernels-bench/kv_fp8_decode.py [--variants]
"""

import argparse
import importlib
import itertools

import torch
from sweep_quantized_gemv import streamed_us

from infer.kernels import paged_attention, store_kv
from infer.kernels.kv_fp8 import quantize_fp8_ref

HEADS, KV_HEADS, HEAD_DIM, ROWS, BLOCK_SIZE, LAYERS = 32, 8, 128, 64, 16, 8
# The modules (infer.kernels exports a function under their package's name).
launch_module = importlib.import_module("infer.kernels.paged_attention.launch")
decode_module = importlib.import_module("infer.kernels.paged_attention.decode")
# The fp8 kernel's knobs `--variants` sets: its dots, the keys a loop step (as bytes of fp8
# keys: 4 KiB is 32 keys of 128 dims), and the decode kernel's pipeline stages (bf16's are timed
# before the sweep and the defaults put back after it).
VARIANT_KNOBS = {
    "_FP8_F16_DOTS": launch_module,
    "_FP8_DECODE_TILE_BYTES": decode_module,
    "_DECODE_STAGES": decode_module,
}


def caches(seq_len: int, fp8: bool):
    num_blocks = ROWS * seq_len // BLOCK_SIZE
    layers = []
    for _ in range(LAYERS):
        k, v = (
            torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        if fp8:
            (k, ks), (v, vs) = quantize_fp8_ref(k), quantize_fp8_ref(v)
            layers.append((k, v, ks, vs))
        else:
            layers.append((k, v, None, None))
    return layers, num_blocks


def attention_us(seq_len: int, prepared, flush: torch.Tensor) -> float:
    layers, num_blocks = prepared
    q = torch.randn(ROWS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(ROWS, -1)
    seq_lens = torch.full((ROWS,), seq_len, device="cuda", dtype=torch.int32)
    query_start_loc = torch.arange(ROWS + 1, device="cuda", dtype=torch.int32)

    def call(k, v, ks, vs):
        return lambda: paged_attention(
            q, k, v, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=tables,
            num_decode_rows=ROWS, max_query_len=1, max_seq_len=seq_len, scale=HEAD_DIM**-0.5,
            out=out, k_scales=ks, v_scales=vs,
        )  # fmt: skip

    calls = []
    for layer in layers:
        calls += [lambda: flush.fill_(1), call(*layer)]
    pair = 2 * streamed_us(calls, repeats=7)
    write = streamed_us([lambda: flush.fill_(1)] * 16, repeats=7)
    return pair - write


def store_us(fp8: bool) -> float:
    k, v = (torch.randn(ROWS, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = [torch.zeros(4096, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(4096, BLOCK_SIZE, KV_HEADS, device="cuda", dtype=torch.uint8) for _ in range(2)]
    slots = torch.randperm(4096 * BLOCK_SIZE, device="cuda")[:ROWS]
    extra = dict(k_scales=scales[0], v_scales=scales[1]) if fp8 else {}
    return streamed_us([lambda: store_kv(k, v, *cache, slots, **extra)] * 32, repeats=7)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args()
    flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    print(f"store_kv, {ROWS} tokens: bf16 {store_us(False):.2f} µs, fp8 {store_us(True):.2f} µs")
    defaults = {name: getattr(module, name) for name, module in VARIANT_KNOBS.items()}
    print("| keys a row | bf16 µs | fp8 µs | fp8 / bf16 |")
    for seq_len in (512, 1024, 2048, 4096, 16384):
        bf16 = attention_us(seq_len, caches(seq_len, False), flush)
        fp8_caches = caches(seq_len, True)
        fp8 = attention_us(seq_len, fp8_caches, flush)
        print(f"| {seq_len} | {bf16:.1f} | {fp8:.1f} | {fp8 / bf16:.2f} |", flush=True)
        if args.variants and seq_len in (1024, 16384):
            for f16, block_n, stages in itertools.product((False, True), (32, 64, 128), (2, 3)):
                launch_module._FP8_F16_DOTS, decode_module._DECODE_STAGES = f16, stages
                decode_module._FP8_DECODE_TILE_BYTES = block_n * HEAD_DIM
                us = attention_us(seq_len, fp8_caches, flush)
                print(
                    f"|   f16 {f16} keys {block_n} stages {stages} | | {us:.1f} | {us / bf16:.2f} |",
                    flush=True,
                )
            for name, value in defaults.items():
                setattr(VARIANT_KNOBS[name], name, value)
        del fp8_caches


if __name__ == "__main__":
    main()
