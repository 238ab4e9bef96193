"""A one-row int4 GEMV over another packed layout, against `int4_linear`'s on Qwen3-8B's shapes.

`int4_linear`'s layout packs 8 columns of one row into a 32-bit word, so each word's 8 products
need 8 columns of x, widened and summed per thread; Triton gives a thread 2 rows of them in the
fastest tiles (docs/benchmarks/quantization.md#the-int4-gemvs-code-compiled-for-sm_90-without-a-gpu).
Here a word holds one column of 8 rows (`pack_rows8`): its 8 products take one x, each into its
own row's sum, so a thread's x costs an eighth as much a weight, and x's tile loads in the
words' layout (4 columns a thread). Compiled for sm_90 without a GPU (Triton 3.9), 32 x 8 rows
a program, 4 warps: 96 registers, no shared memory, 876 instructions a group for 256 weights
a thread (3.4 a weight; int4_linear's default tiles: 4.7).

Each shape runs back to back on distinct weight copies from one CUDA graph (as the model's
layers run), µs a call, both kernels with the sum of K splits (one kernel, int4_linear's) where
they split; outputs checked against `int4_linear_ref` on the same weights. Needs a CUDA GPU.

    python experiments/int4_rows8_gemv.py

On an H200 (2026-12-01, 8500efc) it was 1.48x faster on gate_up's shape and 0.85-1.05x on the
other three: docs/benchmarks/quantization.md#a-word-of-8-rows-instead-of-8-columns-an-experiment.
"""

import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from infer.kernels.gemv.int4 import _BASE, _word_bits
from infer.kernels.gemv.streaming import _sum_splits
from infer.kernels.pdl import launch_options


def pack_rows8(q: torch.Tensor) -> torch.Tensor:
    """[N, K] nibbles (N a multiple of 8) -> [N // 8, K] int32: word (b, k) holds rows 8b..8b+7 of
    column k, row 8b + p in bits 4p..4p+3."""
    n, k = q.shape
    q = q.to(torch.int64).view(n // 8, 8, k)
    shifts = (4 * torch.arange(8, device=q.device)).view(1, 8, 1)
    words = (q << shifts).sum(dim=1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of the low 32 bits


@triton.jit
def _group_term(t, scale_ptr, zero_ptr, mask, x_sum):
    """One row of each word's group: its scale times (sum of (128 + q) x - (128 + zero) sum of x)."""
    scale = tl.load(scale_ptr, mask=mask).to(tl.float32)
    offset = tl.load(zero_ptr, mask=mask).to(tl.float32) + _BASE
    return scale * (tl.sum(t, axis=1) - offset * x_sum)


@triton.jit
def _rows8_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    N,
    K,
    groups_per_split,
    GROUP_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    COLS: tl.constexpr,
    PRMT: tl.constexpr,
):
    """x [K] bf16; w [N // 8, K] int32 (pack_rows8); scale, zero [G, N] (group-major); out [S, N] fp32."""
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    split = tl.program_id(1)
    mask = blocks < N // 8
    # Columns of a step in runs of 4: the words' and x's loads then both take 4 a thread (16
    # and 8 bytes), so x's tile has the words' layout and no conversion between them.
    c = tl.arange(0, COLS)
    c = (c // 4) * 4 + c % 4
    g0 = split * groups_per_split
    w_ptrs = w_ptr + blocks.to(tl.int64)[:, None] * K + g0 * GROUP_SIZE + c[None, :]
    x_ptrs = x_ptr + g0 * GROUP_SIZE + c[None, :] + 0 * blocks[:, None]
    acc0 = tl.zeros([BLOCK_B], tl.float32)
    acc1 = tl.zeros([BLOCK_B], tl.float32)
    acc2 = tl.zeros([BLOCK_B], tl.float32)
    acc3 = tl.zeros([BLOCK_B], tl.float32)
    acc4 = tl.zeros([BLOCK_B], tl.float32)
    acc5 = tl.zeros([BLOCK_B], tl.float32)
    acc6 = tl.zeros([BLOCK_B], tl.float32)
    acc7 = tl.zeros([BLOCK_B], tl.float32)
    rows = 8 * blocks
    for g in range(g0, g0 + groups_per_split):
        t0 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t1 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t2 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t3 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t4 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t5 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t6 = tl.zeros([BLOCK_B, COLS], tl.float32)
        t7 = tl.zeros([BLOCK_B, COLS], tl.float32)
        xs = tl.zeros([BLOCK_B, COLS], tl.float32)
        for _ in tl.static_range(GROUP_SIZE // COLS):
            w = tl.load(w_ptrs, mask=mask[:, None], other=0)
            x = tl.load(x_ptrs).to(tl.float32)
            bits = _word_bits(w, PRMT)
            t0 += bits[0].to(tl.float32, bitcast=True) * x
            t1 += bits[1].to(tl.float32, bitcast=True) * x
            t2 += bits[2].to(tl.float32, bitcast=True) * x
            t3 += bits[3].to(tl.float32, bitcast=True) * x
            t4 += bits[4].to(tl.float32, bitcast=True) * x
            t5 += bits[5].to(tl.float32, bitcast=True) * x
            t6 += bits[6].to(tl.float32, bitcast=True) * x
            t7 += bits[7].to(tl.float32, bitcast=True) * x
            xs += x
            w_ptrs += COLS
            x_ptrs += COLS
        x_sum = tl.sum(xs, axis=1)
        sp = scale_ptr + g * N + rows
        zp = zero_ptr + g * N + rows
        acc0 += _group_term(t0, sp + 0, zp + 0, mask, x_sum)
        acc1 += _group_term(t1, sp + 1, zp + 1, mask, x_sum)
        acc2 += _group_term(t2, sp + 2, zp + 2, mask, x_sum)
        acc3 += _group_term(t3, sp + 3, zp + 3, mask, x_sum)
        acc4 += _group_term(t4, sp + 4, zp + 4, mask, x_sum)
        acc5 += _group_term(t5, sp + 5, zp + 5, mask, x_sum)
        acc6 += _group_term(t6, sp + 6, zp + 6, mask, x_sum)
        acc7 += _group_term(t7, sp + 7, zp + 7, mask, x_sum)
    out = out_ptr + split * N + rows
    tl.store(out + 0, acc0, mask=mask)
    tl.store(out + 1, acc1, mask=mask)
    tl.store(out + 2, acc2, mask=mask)
    tl.store(out + 3, acc3, mask=mask)
    tl.store(out + 4, acc4, mask=mask)
    tl.store(out + 5, acc5, mask=mask)
    tl.store(out + 6, acc6, mask=mask)
    tl.store(out + 7, acc7, mask=mask)


def rows8_gemv(x, w8, scale_t, zero_t, group_size, block_b=32, cols=16, splits=1, warps=4, prmt=True):
    n, k = w8.shape[0] * 8, w8.shape[1]
    groups = k // group_size
    assert groups % splits == 0
    part = torch.empty((splits, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n // 8, block_b), splits)
    _rows8_gemv_kernel[grid](
        x,
        w8,
        scale_t,
        zero_t,
        part,
        n,
        k,
        groups // splits,
        GROUP_SIZE=group_size,
        BLOCK_B=block_b,
        COLS=cols,
        PRMT=prmt,
        num_warps=warps,
    )
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _sum_splits(part.view(splits, 1, n), None, out, launch_options(x, False))  # in split order
    return out[0]


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels-bench"))
from harness import copy_bandwidth_gbps  # noqa: E402
from sweep_quantized_gemv import SHAPES, STREAMED_BYTES, streamed_us  # noqa: E402

from infer.kernels import int4_linear_ref, pack_int4  # noqa: E402
from infer.kernels.gemv.int4_linear import _launch as int4_launch  # noqa: E402

GROUP = 128


def weights(n: int, k: int) -> tuple:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // GROUP, device="cuda") / (5 * k**0.5)).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8, device="cuda")
    return q, scales, zeros


def main() -> None:
    device = torch.cuda.get_device_name()
    print(f"copy bandwidth {copy_bandwidth_gbps():.0f} GB/s; {device}, triton {triton.__version__}")
    configs = list(itertools.product([8, 16, 32, 64], [16], [2, 4, 8], [4, 8, 16, 32]))
    for name, (n, k) in SHAPES.items():
        count = max(2, int(2 * STREAMED_BYTES // (n * k)))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        copies = [weights(n, k) for _ in range(count)]
        ours = [(pack_int4(q), s, z) for q, s, z in copies]
        rows8 = [(pack_rows8(q), s.t().contiguous(), z.t().contiguous()) for q, s, z in copies]
        q, s, z = copies[0]
        want = int4_linear_ref(x, ours[0][0], s, z, GROUP).float()
        scale = want.abs().max().item()
        base = streamed_us([functools.partial(int4_launch, x, *w, GROUP, None) for w in ours])
        err = (int4_launch(x, *ours[0], GROUP, None).float() - want).abs().max().item() / scale
        ideal = n * k * (0.5 + 3 / GROUP) / (copy_bandwidth_gbps() * 1e3)
        print(
            f"{name} {n}x{k}: int4_linear {base:.1f} us (error {err:.1e} of max), ideal {ideal:.1f} us",
            flush=True,
        )
        results = []
        for block_b, cols, warps, splits in configs:
            if (k // GROUP) % splits:
                continue
            try:
                got = rows8_gemv(x[0], *rows8[0], GROUP, block_b, cols, splits, warps).float()
            except Exception as error:  # a configuration Triton cannot build: skipped
                print(f"  {block_b} x 8 rows, {cols} cols, {warps} warps, {splits}: {type(error).__name__}")
                continue
            err = (got - want[0]).abs().max().item() / scale
            config = (block_b, cols, splits, warps)
            us = streamed_us([functools.partial(rows8_gemv, x[0], *w, GROUP, *config) for w in rows8])
            results.append((us, block_b, cols, warps, splits, err))
        for us, block_b, cols, warps, splits, err in sorted(results)[:6]:
            print(
                f"  rows8 {block_b} x 8 rows, {cols} columns, {warps} warps, split {splits}: {us:.1f} us "
                f"({base / us:.2f}x int4_linear), error {err:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
