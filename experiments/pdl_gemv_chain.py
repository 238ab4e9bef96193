"""Does programmatic dependent launch (PDL) take the fixed cost out of a chain of decode GEMVs?

A question for issues 15 and 16. An 8-bit
batch-1 decode of Qwen3-8B is 144 GEMVs a token, each of which streams its weight at about the
efficiency of cuBLAS on bf16 (docs/benchmarks/quantization.md) but pays a launch, a ramp and a
tail whose cost does not shrink with the weight's bytes. With PDL, a kernel's programs may start
while the kernel before it drains; they wait (`gdc_wait`) only before reading what it wrote.
A GEMV's weight never depends on the kernel before it, so its first weight tile can be loaded
before the wait.

Three variants of one int8 per-channel GEMV kernel (a stand-in for quantized_linear's M = 1 path:
16-byte weight loads, fp32 accumulation, one scale per row), chained over Qwen3-8B's four
projections for 36 layers (each GEMV reads the previous one's output), captured in one CUDA
graph:
- `plain`: launched as today;
- `pdl`: launched with PDL; each program lets the next kernel launch at once, then waits before
  its first load;
- `pdl+prefetch`: the same, with the first weight tile loaded before the wait.

The answer on an H100 (2026-11-26): in this chain, 3131 µs plain, 3020 with PDL and 2890 with the
early tile. In the model, where the kernels between the GEMVs did not take part, both lost;
docs/benchmarks/quantization.md has the numbers. Every kernel of infer.kernels now takes part
(`infer.kernels.pdl`, `EngineConfig.use_pdl`), releasing the next kernel first as here, and the
GEMV loads its first tile before its wait (docs/benchmarks/generation.md).

Needs a CUDA GPU of compute capability 9.0 or more.

    PYTHONPATH=kernels-bench python experiments/pdl_gemv_chain.py [--layers 36] [--json FILE]
"""

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from sweep_quantized_gemv import streamed_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CHAIN = ("qkv", "o", "gate_up", "down")


@triton.jit
def _gemv_int8_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    USE_GDC: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        w = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if not PREFETCH:
            w = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
        x = tl.load(x_ptr + k0 + cols).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
        if PREFETCH:
            w = tl.load(w_ptrs, mask=row_mask[:, None] & (k0 + BLOCK_K < K), other=0)
    y = tl.sum(acc, axis=1) * tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def gemv(x, weight, scale, out, *, use_gdc: bool, prefetch: bool) -> None:
    N, K = weight.shape  # x may be longer than K: the kernel reads its first K entries
    block_n, block_k, warps = (16, 512, 8) if N >= 5120 and K < 8192 else (8, 1024, 4)
    _gemv_int8_kernel[(triton.cdiv(N, block_n),)](
        x,
        weight,
        scale,
        out,
        N,
        K,
        USE_GDC=use_gdc,
        PREFETCH=prefetch,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=1,
        launch_pdl=use_gdc,
    )


def chain_calls(layers, x0, variant: str):
    use_gdc, prefetch = {"plain": (False, False), "pdl": (True, False), "pdl+prefetch": (True, True)}[variant]
    calls, x = [], x0
    for layer in layers:
        for name in CHAIN:
            weight, scale, out = layer[name]
            calls.append(
                lambda x=x, w=weight, s=scale, o=out: gemv(x, w, s, o, use_gdc=use_gdc, prefetch=prefetch)
            )
            x = out
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layer = {}
        for name, (n, k) in SHAPES.items():
            weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
            scale = torch.rand(n, device="cuda", generator=gen) / (127 * k**0.5)
            layer[name] = (weight, scale, torch.empty(n, dtype=torch.bfloat16, device="cuda"))
        layers.append(layer)
    x0 = torch.randn(max(k for _, k in SHAPES.values()), dtype=torch.bfloat16, device="cuda", generator=gen)
    weight_bytes = sum(w.numel() for layer in layers for w, _, _ in layer.values())

    results, outputs = {}, {}
    for variant in ("plain", "pdl", "pdl+prefetch", "plain", "pdl", "pdl+prefetch"):
        calls = chain_calls(layers, x0, variant)
        us = streamed_us(calls, repeats=7) * len(calls)  # µs a replay
        results.setdefault(variant, []).append(us)
        outputs[variant] = layers[-1]["down"][2].float().clone()
    # Every variant computes the same chain: the last output must not depend on the launch mode.
    for variant, out in outputs.items():
        torch.testing.assert_close(out, outputs["plain"], rtol=0, atol=0, msg=f"{variant} differs from plain")
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{args.layers} layers x {len(CHAIN)} int8 GEMVs, {weight_bytes / 1e9:.2f} GB of weights a replay")
    print("| variant | µs a replay (two runs) | µs a GEMV | weight GB/s |")
    print("|---|---|---:|---:|")
    for variant, runs in results.items():
        best = min(runs)
        calls = args.layers * len(CHAIN)
        print(
            f"| {variant} | {' / '.join(f'{r:.0f}' for r in runs)} | {best / calls:.2f} | "
            f"{weight_bytes / (best * 1e-6) / 1e9:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": device, "layers": args.layers, "us": results}, indent=2))


if __name__ == "__main__":
    main()
