"""An experiment: the one-row int4 GEMV on tensor cores (mma.sync m16n8k16), written in Gluon
(Triton's dialect with explicit layouts), against int4_linear's GEMV of FMAs (gemv.int4_gemv).

The weight tile is the MMA's left operand (M: 16 weight rows a warp's tile) and x its right one
(all 8 columns x, one of them read). Each thread loads, as 16-byte words, exactly the rows and K
pairs its fragments hold, so no operand changes layout (every `convert_layout` below is asserted
trivial at compile time): `((w >> 4p) & 0x000F000F) | 0x43004300` (a shift and one LOP3) is one
fragment register, the bf16 pair 128 + q of columns 8m + p and 8m + p + 4 of word m (exact). The
K order of the MMA is chosen so that a thread's pairs come from its own 4 words; x is taken in
the same order. A group's sums, less (128 + zero) times the group's sum of x, times its scale,
go into the fp32 accumulator: no FMA a weight on the CUDA cores, about 7 integer instructions a
word of 8 weights and an MMA a 256.

Options: TILED, the weight as `[N / 8, K / 128, 8, 16]` words (a warp's 8 rows of a group are 512
contiguous bytes) instead of int4_layout's rows; X_SMEM, the program's x stored once in shared
memory in each lane's fragment order, with each group's sum of x (else x from global memory and
the sums from `x_sum_ptr`); AHEAD, the next step's words loaded before this step's are summed;
GROUPS, groups a step. The split-K parts are left in `out_ptr[split]` (summed by torch, untimed).

    python experiments/int4_mma_gluon.py             # on a GPU: check against int4_linear_ref, time
    python experiments/int4_mma_gluon.py --offline   # compile for sm_90 here: registers, the loop's SASS
    python experiments/int4_mma_gluon.py --in-the-kernels   # gemv.int4_mma against the Triton GEMV
"""

import argparse
import collections
import functools
import importlib
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from infer.kernels.gemv.int4_mma import _layouts, _stage_x

# Nibbles p and p + 4 of a word as the bf16 pair 128 + q (low half: nibble p), one 32-bit register.
# Elementwise over [..., 2] (the word twice), two elements a call packed into the output register.
_PAIR0 = gl.constexpr("{ .reg .b32 t; mov.b32 t, $1; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }")
_PAIR1 = gl.constexpr("{ .reg .b32 t; shr.u32 t, $1, 4; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }")
_PAIR2 = gl.constexpr("{ .reg .b32 t; shr.u32 t, $1, 8; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }")
_PAIR3 = gl.constexpr("{ .reg .b32 t; shr.u32 t, $1, 12; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@gluon.jit
def _pair(ww, asm: gl.constexpr):
    """`ww` [..., 2]: each word twice -> [..., 2] bf16, nibbles p and p + 4 as 128 + q."""
    return gl.inline_asm_elementwise(asm, "=r,r,r", [ww], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _group_sum(w, word, x_ptr, x_offsets, x_sum_ptr, scale_ptrs, zero_ptrs, x_smem, sum_smem, local,
               a_layout: gl.constexpr, b_layout: gl.constexpr, mma: gl.constexpr, x_layout: gl.constexpr,
               BLOCK_N: gl.constexpr, X_SMEM: gl.constexpr):  # fmt: skip
    """One group's `[BLOCK_N, 16]` words (from column 8 `word`; the split's group `local`) ->
    `[BLOCK_N, 8]` scaled sums (the 8 columns alike)."""
    group = word // 16
    scale = gl.load(scale_ptrs + group).to(gl.float32)
    offset = gl.load(zero_ptrs + group).to(gl.float32) + 128.0
    # The MMA's K index k = 32 i + 16 h + 8 s + 2 c + b is column 32 c + 8 i + p + 4 b, p = 2 h + s:
    # lane c's right-operand fragments hold columns 32 c .. 32 c + 31 of the group.
    if X_SMEM:  # in shared memory as e = 8 i + 4 h + 2 s + b: the fragments' register order
        xs = x_smem.index(local).reshape([4, 32]).load(gl.SliceLayout(0, x_layout))  # [c, e]
        xs = gl.expand_dims(xs, 0).broadcast_to(8, 4, 32)
        xs = gl.permute(gl.reshape(xs, [8, 4, 4, 2, 2, 2]), [2, 3, 4, 1, 5, 0])  # [i, h, s, c, b, n]
        x_sum = sum_smem.index(local).load(gl.SliceLayout(0, mma))[None, :]  # [1, 8], alike
    else:  # column 32 c + j, j = 8 i + 4 b + 2 h + s, from global memory
        xs = gl.load(x_ptr + 8 * word + x_offsets)  # [n, c, j]
        xs = gl.permute(gl.reshape(xs, [8, 4, 4, 2, 2, 2]), [2, 4, 5, 1, 3, 0])  # [i, h, s, c, b, n]
        x_sum = gl.load(x_sum_ptr + group)
    xb = gl.convert_layout(gl.reshape(xs, [128, 8]), b_layout, assert_trivial=True)
    w4 = gl.reshape(w, [BLOCK_N, 4, 4])  # [n, c, i]: lane c's words 4 c + i
    ww = gl.join(w4, w4)
    low = gl.join(_pair(ww, _PAIR0), _pair(ww, _PAIR1))  # [n, c, i, b, s], h = 0
    high = gl.join(_pair(ww, _PAIR2), _pair(ww, _PAIR3))  # h = 1
    e = gl.permute(gl.join(low, high), [0, 2, 5, 4, 1, 3])  # [n, i, h, s, c, b]
    a = gl.convert_layout(gl.reshape(e, [BLOCK_N, 128]), a_layout, assert_trivial=True)
    part = mma_v2(a, xb, gl.zeros([BLOCK_N, 8], gl.float32, layout=mma))
    return (part - offset[:, None] * x_sum) * scale[:, None]


@gluon.jit
def _mma_gemv_kernel(
    x_ptr, x_sum_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, N, w_row_stride, scale_row_stride,
    zero_row_stride, words_per_split, GROUP_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
    AHEAD: gl.constexpr, GROUPS: gl.constexpr, TILED: gl.constexpr, X_SMEM: gl.constexpr,
    SPLIT_GROUPS: gl.constexpr, words: gl.constexpr, x_layout: gl.constexpr,
):  # fmt: skip
    """Program (tile, split): `out_ptr[split, rows]`, fp32. `words`, `x_layout`: `layouts()`.
    `w_row_stride`: a row's words (K / 8) in either layout."""
    gl.static_assert(GROUP_SIZE == 128)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    STEP: gl.constexpr = 16 * GROUPS  # a row's words a step
    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words))
    split = gl.program_id(1)
    word_start = split * words_per_split
    end = word_start + words_per_split
    jw = gl.arange(0, STEP, layout=gl.SliceLayout(0, words))
    if TILED:
        block = (rows // 8).to(gl.int64)[:, None] * (8 * w_row_stride)
        inside = (rows % 8)[:, None] * 16 + (jw // 16)[None, :] * 128 + (jw % 16)[None, :]
        w_ptrs = w_ptr + block + word_start * 8 + inside
        STEP_WORDS: gl.constexpr = 128 * GROUPS
    else:
        w_ptrs = w_ptr + rows.to(gl.int64)[:, None] * w_row_stride + word_start + jw[None, :]
        STEP_WORDS: gl.constexpr = STEP
    x_smem = 0
    sum_smem = 0
    if X_SMEM:  # the split's x in the fragments' order, and each group's sum of it (SPLIT_GROUPS: 2^n)
        x_smem, sum_smem = _stage_x(x_ptr, word_start, words_per_split, WARPS, SPLIT_GROUPS)
    xn = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_layout)))
    xc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_layout)))
    xj = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_layout)))
    x_offsets = 0 * xn[:, None, None] + 32 * xc[None, :, None] + xj[None, None, :]
    mma_rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    scale_ptrs = scale_ptr + mma_rows * scale_row_stride
    zero_ptrs = zero_ptr + mma_rows * zero_row_stride
    acc = gl.zeros([BLOCK_N, 8], gl.float32, layout=mma)
    if AHEAD == 1:
        w = gl.load(w_ptrs)
    for word in range(word_start, end, STEP):
        if AHEAD == 1:
            w_next = gl.load(w_ptrs + STEP_WORDS, mask=word + STEP < end, other=0)
        else:
            w = gl.load(w_ptrs)
        local = (word - word_start) // 16
        if GROUPS == 1:
            acc += _group_sum(w, word, x_ptr, x_offsets, x_sum_ptr, scale_ptrs, zero_ptrs, x_smem, sum_smem,
                              local, a_layout, b_layout, mma, x_layout, BLOCK_N, X_SMEM)  # fmt: skip
        else:
            gl.static_assert(GROUPS == 2)
            w0, w1 = gl.split(gl.permute(gl.reshape(w, [BLOCK_N, 2, 16]), [0, 2, 1]))
            acc += _group_sum(w0, word, x_ptr, x_offsets, x_sum_ptr, scale_ptrs, zero_ptrs, x_smem, sum_smem,
                              local, a_layout, b_layout, mma, x_layout, BLOCK_N, X_SMEM)  # fmt: skip
            acc += _group_sum(w1, word + 16, x_ptr, x_offsets, x_sum_ptr, scale_ptrs, zero_ptrs, x_smem,
                              sum_smem, local + 1, a_layout, b_layout, mma, x_layout, BLOCK_N,
                              X_SMEM)  # fmt: skip
        if AHEAD == 1:
            w = w_next
        w_ptrs += STEP_WORDS
    columns = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    y = gl.sum(gl.where((columns == 0)[None, :], acc, 0.0), axis=1)
    gl.store(out_ptr + split * N + mma_rows, y)


def tiled(qweight):
    """int4_layout's `[N, K // 2]` uint8 -> `[N / 8, K / 128, 8, 16]` int32 words."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    return qweight.view(_torch().int32).view(n // 8, 8, k // 128, 16).permute(0, 2, 1, 3).contiguous()


def _torch():
    import torch

    return torch


def launch(
    x, x_sum, weight, scales, zeros, out, *, n, k, block_n, warps, splits, ahead, groups, tile, x_smem
):
    words, x_layout = _layouts(block_n, warps, groups)
    _mma_gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, x_sum, weight, scales, zeros, out, n, k // 8, scales.stride(0), zeros.stride(0), k // 8 // splits,
        GROUP_SIZE=128, BLOCK_N=block_n, WARPS=warps, AHEAD=ahead, GROUPS=groups, TILED=tile, X_SMEM=x_smem,
        SPLIT_GROUPS=triton.next_power_of_2(k // 128 // splits), words=words, x_layout=x_layout,
        num_warps=warps,
    )  # fmt: skip


def _call(x, x_sum, tiles, n, k, w, config, out):
    """One configuration's launch on weight `w` (`quantized_weights`' tuple; its tiled words in `tiles`)."""
    block_n, warps, splits, ahead, groups, tile, x_smem = config
    weight = tiles[w[0].data_ptr()] if tile else w[0].view(_torch().int32)
    launch(x, x_sum, weight, w[1], w[2], out, n=n, k=k, block_n=block_n, warps=warps, splits=splits,
           ahead=ahead, groups=groups, tile=tile, x_smem=x_smem)  # fmt: skip


def gpu(configs: list[tuple]) -> None:
    """Each shape: every configuration checked against int4_linear_ref, then µs a call back to
    back on distinct weights from one CUDA graph (the best of three alternated runs), against
    int4_linear (its defaults, without PDL as here)."""
    torch = _torch()
    sys.path.insert(0, str(Path(__file__).parents[1] / "kernels-bench"))
    from sweep_quantized_gemv import quantized_weights, streamed_us

    from infer.kernels.gemv.references import int4_linear_ref

    int4_linear = importlib.import_module("infer.kernels.gemv.int4_linear")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    totals = collections.Counter()
    for name, (n, k) in SHAPES.items():
        weights = quantized_weights("int4", n, k)
        tiles = {w[0].data_ptr(): tiled(w[0]) for w in weights}
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        x_sum = x.float().view(-1, 128).sum(-1)
        expected = int4_linear_ref(x[None], *weights[0]).float()[0]
        largest = expected.abs().max().item()

        call = functools.partial(_call, x, x_sum, tiles, n, k)
        runs = collections.defaultdict(list)
        valid = [c for c in configs if (k // 8 // c[2]) % (16 * c[4]) == 0 and c[0] >= 16 * c[1]]
        for repeat in range(3):
            runs["int4_linear"].append(
                streamed_us([functools.partial(int4_linear._launch, x[None], *w[:4], None) for w in weights])
            )
            for config in valid:
                out = torch.empty((config[2], n), dtype=torch.float32, device="cuda")
                if repeat == 0:
                    call(weights[0], config, out)
                    error = (out.sum(0) - expected).abs().max().item() / largest
                    assert error < 1e-2, (config, error)
                runs[config].append(streamed_us([functools.partial(call, w, config, out) for w in weights]))
        best = {label: min(times) for label, times in runs.items()}
        base = best.pop("int4_linear")
        for tile in (0, 1):
            for x_smem in (0, 1):
                us, config = min((us, c) for c, us in best.items() if c[5] == tile and c[6] == x_smem)
                print(f"{name} tiled {tile}, x in shared memory {x_smem}: {us:.2f} us {config}", flush=True)
                totals[(tile, x_smem)] += us
        us, config = min((us, c) for c, us in best.items())
        print(f"{name}: int4_linear {base:.2f} us, best {us:.2f} {config} ({base / us:.2f}x)", flush=True)
        totals["int4_linear"] += base
    for key, us in totals.items():
        print(f"the four, {key}: {us:.2f} us", flush=True)


# `int4_linear._launch`'s options a kind of `in_the_kernels` run takes.
KINDS = {
    "gemv": {"kernel": "gemv"},
    "mma": {"kernel": "mma"},
    "gemv pdl": {"kernel": "gemv", "pdl": True},
    "mma pdl": {"kernel": "mma", "pdl": True},
}


def in_the_kernels() -> None:
    """`int4_linear._launch`'s Triton GEMV against `kernel="mma"` (gemv.int4_mma), each without
    PDL and with it, and gate|up with its activation: µs a call streamed as `gpu` times them."""
    torch = _torch()
    sys.path.insert(0, str(Path(__file__).parents[1] / "kernels-bench"))
    from sweep_quantized_gemv import quantized_weights, streamed_us

    int4_linear = importlib.import_module("infer.kernels.gemv.int4_linear")
    totals = collections.Counter()
    for name, activation in [*((name, None) for name in SHAPES), ("gate_up", "silu")]:
        n, k = SHAPES[name]
        weights = quantized_weights("int4", n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        runs = {kind: [] for kind in KINDS}
        for _ in range(3):
            for kind, times in runs.items():
                launch = functools.partial(int4_linear._launch, x, activation=activation, **KINDS[kind])
                times.append(streamed_us([functools.partial(launch, *w[:4], None) for w in weights]))
        label = name if activation is None else f"{name} with {activation}"
        print(label, {kind: round(min(times), 2) for kind, times in runs.items()}, flush=True)
        if activation is None:
            totals.update({kind: min(times) for kind, times in runs.items()})
    print("the four:", {kind: round(us, 2) for kind, us in totals.items()})
    for pdl in ("", " pdl"):
        print(f"the four{pdl}: {totals['gemv' + pdl] / totals['mma' + pdl]:.3f}x")


def offline(config: tuple) -> None:
    """Compile one configuration for sm_90 without a GPU: registers, and the K loop's instructions
    (a thread's), as a count and by opcode, with the weights a thread sums a step."""
    from sm90_offline import sm90_signature
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_n, warps, splits, ahead, groups, tile, x_smem = config
    words, x_layout = _layouts(block_n, warps, groups)
    constexprs = dict(
        GROUP_SIZE=128, BLOCK_N=block_n, WARPS=warps, AHEAD=ahead, GROUPS=groups, TILED=tile, X_SMEM=x_smem,
        SPLIT_GROUPS=16, words=words, x_layout=x_layout,
    )  # fmt: skip
    types = dict(
        x_ptr="*bf16", x_sum_ptr="*fp32", w_ptr="*i32", scale_ptr="*bf16", zero_ptr="*u8", out_ptr="*fp32"
    )
    kernel = _mma_gemv_kernel
    signature, constants, attrs = sm90_signature(kernel, constexprs, types=types, default="i32")
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cubin = Path("/tmp") / f"int4_mma_gluon_{compiled.hash}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    usage = subprocess.run(
        [tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True
    )
    sass = subprocess.run([tools / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True).stdout
    cubin.unlink()
    found = re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*)", sass)
    addresses = [int(address, 16) for address, _, _ in found]
    for i, (address, opcode, operands) in enumerate(found):  # the loop: the branch back
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < int(address, 16):
            body = found[addresses.index(int(target.group(1), 16)) : i + 1]
            opcodes = collections.Counter(op.split(".")[0] for _, op, _ in body)
            weights = block_n * 128 * groups // (32 * warps)
            registers = re.search(r"REG:(\d+)", usage.stdout).group(1)
            print(f"{config}: {registers} registers, the loop {len(body)} instructions for {weights} weights")
            print(f"  {len(body) / weights:.2f} a weight; {opcodes.most_common(10)}")


# (rows, warps, K splits, a step ahead, groups a step, tiled, x in shared memory)
CONFIGS = [
    (b, w, s, a, g, t, x)
    for b in (64, 128, 256)
    for w in (4, 8)
    for s in (2, 4, 8)
    for a in (0, 1)
    for g in (1, 2)
    for t in (0, 1)
    for x in (0, 1)
]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 here; no GPU")
    parser.add_argument("--in-the-kernels", action="store_true", help="int4_linear against its kernel='mma'")
    args = parser.parse_args()
    if args.in_the_kernels:
        in_the_kernels()
    elif args.offline:
        for config in [
            (128, 8, 8, 1, 2, 1, 1),
            (128, 4, 8, 0, 1, 1, 1),
            (128, 4, 8, 0, 1, 1, 0),
            (64, 4, 8, 0, 1, 0, 0),
        ]:
            offline(config)
    else:
        gpu(CONFIGS)
