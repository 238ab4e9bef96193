"""infer.kernels' C kernels for the CPU (`native=True`) against the ATen paths they replace,
alternated in one process on SmolLM2-135M's shapes, 2 threads:

- `int8_linear_cpu` of one row, per Linear shape: each shape as many distinct weights (more bytes
  than the caches hold), as a decode step streams them;
- `paged_attention_cpu` of one decode row, 9 query heads over 3 KV heads of 64, at 384 keys in
  blocks of 16: one layer's attention, its cache warm.

    python kernels-bench/cpu_native_kernels.py
"""

import time

import torch

from infer.kernels import (
    int8_cpu_scale,
    int8_linear_cpu,
    native_cpu_kernels_available,
    paged_attention_cpu,
)

LINEARS = {
    "q|k|v": (960, 576),
    "o": (576, 576),
    "gate|up": (3072, 576),
    "down": (576, 1536),
    "LM head": (49152, 576),
}
STREAMED_BYTES = 64e6


def us_per_call(calls, repeats: int) -> float:
    for call in calls[:3]:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (repeats * len(calls)) * 1e6


def alternated(name: str, calls, repeats: int, bytes_per_call: float | None = None) -> None:
    """`calls(native)`: the calls to time with the C kernel (True) or ATen's (False)."""
    for _ in range(2):
        times = {}
        for native in (False, True):
            times[native] = us_per_call(calls(native), repeats)
        rate = "" if bytes_per_call is None else f" ({bytes_per_call / times[True] / 1e3:.1f} GB/s)"
        speedup = times[False] / times[True]
        print(f"{name}: ATen {times[False]:.1f} µs, C {times[True]:.1f} µs{rate}, {speedup:.2f}x")


def main() -> None:
    torch.set_num_threads(2)
    assert native_cpu_kernels_available(), "the C kernels do not build here"
    torch.manual_seed(0)
    for name, (n, k) in LINEARS.items():
        copies = max(2, int(STREAMED_BYTES // (n * k)))
        weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        scales = [int8_cpu_scale(torch.rand(n, 1) / 127) for _ in range(copies)]
        x = torch.randn(1, k)

        def calls(native, x=x, weights=weights, scales=scales):
            return [
                lambda w=w, s=s: int8_linear_cpu(x, w, s, native=native)
                for w, s in zip(weights, scales, strict=True)
            ]

        alternated(f"int8 {name} {n}x{k}", calls, repeats=20, bytes_per_call=n * k)
    heads, kv_heads, head_dim, block_size, keys = 9, 3, 64, 16, 384
    k_cache = torch.randn(keys // block_size + 2, block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, heads, head_dim)
    kwargs = dict(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([keys], dtype=torch.int32),
        block_tables=torch.arange(1, keys // block_size + 1, dtype=torch.int32)[None],
        num_decode_rows=1,
        max_query_len=1,
        max_seq_len=keys,
        scale=head_dim**-0.5,
        decode_key_slots=(range(block_size, block_size + keys),),  # the SDPA path's view
    )
    alternated(
        f"decode attention, {keys} keys",
        lambda native: [lambda: paged_attention_cpu(q, k_cache, v_cache, native=native, **kwargs)],
        2000,
    )


if __name__ == "__main__":
    main()
