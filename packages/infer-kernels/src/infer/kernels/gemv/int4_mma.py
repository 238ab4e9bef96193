"""The one-row int4 GEMV on tensor cores (`mma.sync` m16n8k16), written in Gluon, Triton's
dialect in which a kernel states its layouts: `int4_linear`'s kernel for one row of bf16 or fp16
x in groups of 128 (`kernel="mma"`, its default there), the gated gate|up with its activation
too (docs/benchmarks/quantization.md#the-one-row-gemv-on-tensor-cores-in-gluon).

The weight tile is the MMA's left operand (16 weight rows a warp's tile; a thread's fragment holds
rows r and r + 8) and x its right one (its 8 columns alike; column 0 is stored). Each thread loads,
as 16-byte words of `int4_layout`'s rows, exactly the rows and K pairs its fragments hold, so no
operand changes layout (every `convert_layout` is asserted free when the kernel compiles):
`((w >> 4p) & 0x000F000F) | MAGIC` is one fragment register, the pair BASE + q of columns 8m + p and
8m + p + 4 of word m as two bf16 (BASE 128) or fp16 (BASE 1024), exactly. The MMA's K order is
chosen so that a thread's pairs come from its own 4 words of a group, and x is stored once a
program in shared memory in that order, with each group's sum of x. A group's fp32 sums, less
(BASE + zero) times its sum of x, times its scale, go into the accumulator: no FMA a weight on
the CUDA cores, about 7 integer instructions a word of 8 weights and an MMA a 256. Each K split's
sums go to its own row of fp32 partial sums, which the tile's last program adds in split order
with the bias, as `int4_linear`'s GEMV does. Gated, a tile reads half its rows from the gate and
their twins from the up half, and its last program writes `act(gate) * up`. Under PDL the first
words are read before the wait. Triton's interpreter runs no Gluon: CUDA only.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from infer.kernels._dispatch import num_sms
from infer.kernels.gemv.configs import _int4_mma_config, _int4_mma_splits
from infer.kernels.gemv.streaming import split_counts
from infer.kernels.pdl import launch_options

# A fragment register from a word: the word's nibbles p and p + 4 under the exponent of BASE (the
# low half nibble p), as `_pair` calls it on the word twice, two elements a call in one register.
# BASE's bits in each half: 0x4300 is bf16 128, 0x6400 fp16 1024, whose mantissas' last unit is 1.
_PAIR_PTX = "{ .reg .b32 t; shr.u32 t, $1, SHIFT; lop3.b32 $0, t, 0x000F000F, MAGIC, 0xEA; }"
_BF16_PAIR0, _BF16_PAIR1, _BF16_PAIR2, _BF16_PAIR3 = (
    gl.constexpr(_PAIR_PTX.replace("SHIFT", str(4 * p)).replace("MAGIC", "0x43004300")) for p in range(4)
)
_F16_PAIR0, _F16_PAIR1, _F16_PAIR2, _F16_PAIR3 = (
    gl.constexpr(_PAIR_PTX.replace("SHIFT", str(4 * p)).replace("MAGIC", "0x64006400")) for p in range(4)
)
# pdl.await_inputs' two instructions (tl.extra.cuda's gdc_launch_dependents and gdc_wait).
_LAUNCH_DEPENDENTS = gl.constexpr("griddepcontrol.launch_dependents; // $0")
_WAIT = gl.constexpr("griddepcontrol.wait; // $0")
_GROUP = 128  # columns a group: the only group size the kernel takes (16 words a row)


@gluon.jit
def _pair(ww, asm: gl.constexpr, F16: gl.constexpr):
    """`ww` `[..., 2]`, each word twice -> `[..., 2]`: nibbles p and p + 4 as BASE + q."""
    if F16:
        pair = gl.inline_asm_elementwise(asm, "=r,r,r", [ww], dtype=gl.float16, is_pure=True, pack=2)
    else:
        pair = gl.inline_asm_elementwise(asm, "=r,r,r", [ww], dtype=gl.bfloat16, is_pure=True, pack=2)
    return pair


@gluon.jit
def _group_sum(w, local, scale_ptrs, zero_ptrs, x_smem, sum_smem, mma: gl.constexpr, x_layout: gl.constexpr,
               BLOCK_N: gl.constexpr, HAS_ZEROS: gl.constexpr, F16: gl.constexpr):  # fmt: skip
    """One group's `[BLOCK_N, 16]` words (the split's group `local`; `scale_ptrs` and `zero_ptrs`
    at the group's column) -> `[BLOCK_N, 8]` sums times the group's scale (the 8 columns alike)."""
    base: gl.constexpr = 1024.0 if F16 else 128.0
    scale = gl.load(scale_ptrs).to(gl.float32)
    if HAS_ZEROS:
        offset = gl.load(zero_ptrs).to(gl.float32) + base
    else:
        offset = gl.full(scale.shape, base + 8.0, gl.float32, layout=scale.type.layout)
    # x as the fragments hold it: lane c's columns 32 c .. + 31 of the group as e = 8 i + 4 h + 2 s + b
    xs = x_smem.index(local).reshape([4, 32]).load(gl.SliceLayout(0, x_layout))  # [c, e]
    xs = gl.expand_dims(xs, 0).broadcast_to(8, 4, 32)
    xs = gl.permute(gl.reshape(xs, [8, 4, 4, 2, 2, 2]), [2, 3, 4, 1, 5, 0])  # [i, h, s, c, b, n]
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    xb = gl.convert_layout(gl.reshape(xs, [128, 8]), b_layout, assert_trivial=True)
    x_sum = sum_smem.index(local).load(gl.SliceLayout(0, mma))[None, :]  # [1, 8], alike
    # The weights: the MMA's K index k = 32 i + 16 h + 8 s + 2 c + b is column 32 c + 8 i + p + 4 b
    # (p = 2 h + s), nibble p (b = 0) or p + 4 (b = 1) of lane c's word 4 c + i.
    w4 = gl.reshape(w, [BLOCK_N, 4, 4])  # [n, c, i]
    ww = gl.join(w4, w4)
    if F16:
        low = gl.join(_pair(ww, _F16_PAIR0, F16), _pair(ww, _F16_PAIR1, F16))  # [n, c, i, b, s], h = 0
        high = gl.join(_pair(ww, _F16_PAIR2, F16), _pair(ww, _F16_PAIR3, F16))  # h = 1
    else:
        low = gl.join(_pair(ww, _BF16_PAIR0, F16), _pair(ww, _BF16_PAIR1, F16))
        high = gl.join(_pair(ww, _BF16_PAIR2, F16), _pair(ww, _BF16_PAIR3, F16))
    e = gl.permute(gl.join(low, high), [0, 2, 5, 4, 1, 3])  # [n, i, h, s, c, b]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    a = gl.convert_layout(gl.reshape(e, [BLOCK_N, 128]), a_layout, assert_trivial=True)
    part = mma_v2(a, xb, gl.zeros([BLOCK_N, 8], gl.float32, layout=mma))
    return (part - offset[:, None] * x_sum) * scale[:, None]


@gluon.jit
def _stage_x(x_ptr, word_start, words_per_split, WARPS: gl.constexpr, SPLIT_GROUPS: gl.constexpr):
    """The split's x in shared memory as `_group_sum` reads it (`[SPLIT_GROUPS, 128]`: lane c's 32
    columns of a group in its fragments' order), and each group's sum of x (`[SPLIT_GROUPS, 8]`)."""
    staging: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [WARPS, 1, 1], [2, 1, 0])
    group = gl.arange(0, SPLIT_GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, staging)))
    lane = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, staging)))
    e = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, staging)))
    column = 8 * (e >> 3) + 2 * ((e >> 2) & 1) + ((e >> 1) & 1) + 4 * (e & 1)  # 8 i + 2 h + s + 4 b
    index = 128 * group[:, None, None] + 32 * lane[None, :, None] + column[None, None, :]
    x = gl.load(x_ptr + 8 * word_start + index, mask=index < 8 * words_per_split, other=0.0)
    buffers: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # of rank 1, one a group
    whole: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # the same bytes, row-major
    x_smem = gl.allocate_shared_memory(x.dtype, [SPLIT_GROUPS, 128], buffers)
    x_smem._reinterpret(x.dtype, [SPLIT_GROUPS, 128], whole).store(gl.reshape(x, [SPLIT_GROUPS, 128]))
    sums = gl.sum(gl.sum(x.to(gl.float32), axis=2), axis=1)
    sums = gl.expand_dims(sums, 1).broadcast_to(SPLIT_GROUPS, 8)
    sums = gl.convert_layout(sums, gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0]))
    sum_smem = gl.allocate_shared_memory(gl.float32, [SPLIT_GROUPS, 8], buffers)
    sum_smem._reinterpret(gl.float32, [SPLIT_GROUPS, 8], whole).store(sums)
    gl.thread_barrier()
    return x_smem, sum_smem


@gluon.jit
def _await_inputs(PDL: gl.constexpr):
    """pdl.await_inputs in Gluon: with PDL, release the next kernel, then wait for the one before."""
    if PDL:
        gl.inline_asm_elementwise(_LAUNCH_DEPENDENTS, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(_WAIT, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _sum_splits_in_the_last(y, partial_ptr, bias_ptr, out_ptr, count_ptr, N, SPLITS: gl.constexpr,
                            HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """streaming._sum_splits_in_the_last in Gluon: this program's `[BLOCK_N]` sums `y` (a split's
    part) stored, the program that stores its tile's last part adds the SPLITS parts in split
    order, then the bias, into `out_ptr` (x's dtype), as `_split_k_sum_kernel` would; one split:
    `y` plus the bias. `count_ptr`: int32 a tile, zero before the launch and left so."""
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=flat)
    inside = rows < N
    y = gl.convert_layout(y, flat)
    if SPLITS == 1:
        _store_sums(y, bias_ptr, out_ptr, rows, inside, HAS_BIAS)
    else:
        gl.store(partial_ptr + gl.program_id(1) * N + rows, y, mask=inside)
        if _counted_last(count_ptr, SPLITS):
            total = _parts(partial_ptr, rows, inside, N, SPLITS)
            _store_sums(total, bias_ptr, out_ptr, rows, inside, HAS_BIAS)


@gluon.jit
def _gated_in_the_last(y, weight_rows, stored, partial_ptr, bias_ptr, out_ptr, count_ptr, N,
                       SPLITS: gl.constexpr, HAS_BIAS: gl.constexpr, GELU_TANH: gl.constexpr,
                       BLOCK_N: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """`_sum_splits_in_the_last` for a `[gate; up]` weight of 2N rows (`_weight_rows`' GATED
    tile): this program's sums `y` of `weight_rows` (where `stored`) go to its split's row of
    `partial_ptr` (`[SPLITS, 2N]` fp32); the tile's last program sums each row's parts in split
    order, adds the bias, rounds gate and up to out's dtype (as the unfused pair stores them) and
    stores `act(gate) * up` (streaming.gated_rows)."""
    gl.store(partial_ptr + gl.program_id(1) * 2 * N + weight_rows, y, mask=stored)
    if _counted_last(count_ptr, SPLITS):
        HALF: gl.constexpr = BLOCK_N // 2
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        rows = gl.program_id(0) * HALF + gl.arange(0, HALF, layout=flat)
        inside = rows < N
        gate = _parts(partial_ptr, rows, inside, 2 * N, SPLITS)
        up = _parts(partial_ptr + N, rows, inside, 2 * N, SPLITS)
        if HAS_BIAS:
            gate += gl.load(bias_ptr + rows, mask=inside, other=0.0).to(gl.float32)
            up += gl.load(bias_ptr + N + rows, mask=inside, other=0.0).to(gl.float32)
        out_type: gl.constexpr = out_ptr.dtype.element_ty
        gate = gate.to(out_type).to(gl.float32)
        up = up.to(out_type).to(gl.float32)
        gl.store(out_ptr + rows, _gated_activation(gate, up, GELU_TANH).to(out_type), mask=inside)


@gluon.jit
def _gated_activation(gate, up, GELU_TANH: gl.constexpr):
    """activation.gated_activation in Gluon (which calls no triton.jit function): `act(gate) *
    up` in fp32, SiLU or GELU's tanh form as `x * sigmoid(2 z)`, sigmoid as `1 / (1 + exp(-x))`
    (tl.sigmoid's)."""
    if GELU_TANH:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        activated = gate * (1.0 / (1.0 + gl.exp(-2.0 * z)))
    else:
        activated = gate * (1.0 / (1.0 + gl.exp(-gate)))
    return activated * up


@gluon.jit
def _counted_last(count_ptr, SPLITS: gl.constexpr):
    """After every thread's part is stored, count this program's split of its tile (an
    acquire-release atomic): whether it is the tile's last, whose count then goes back to zero
    for the next launch."""
    gl.thread_barrier()
    count = count_ptr + gl.program_id(0)
    last = gl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        gl.store(count, 0)
    return last


@gluon.jit
def _parts(partial_ptr, rows, inside, split_stride, SPLITS: gl.constexpr):
    """The SPLITS parts of `rows` (`split_stride` apart) added in split order, from L2 (other SMs
    stored them)."""
    total = gl.load(partial_ptr + rows, mask=inside, other=0.0, cache_modifier=".cg")
    for split in gl.static_range(1, SPLITS):
        part_ptrs = partial_ptr + split * split_stride + rows
        total += gl.load(part_ptrs, mask=inside, other=0.0, cache_modifier=".cg")
    return total


@gluon.jit
def _store_sums(total, bias_ptr, out_ptr, rows, inside, HAS_BIAS: gl.constexpr):
    """The finished sums of a tile's rows, plus the bias, into `out_ptr` in its dtype."""
    if HAS_BIAS:
        total += gl.load(bias_ptr + rows, mask=inside, other=0.0).to(gl.float32)
    gl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=inside)


@gluon.jit
def _weight_rows(r, N, GATED: gl.constexpr, BLOCK_N: gl.constexpr):
    """The weight rows of this program's tile, for `r` = 0 .. BLOCK_N - 1 in some layout, and
    whether each one's sum is stored: BLOCK_N rows from tile * BLOCK_N; GATED (the weight `[gate;
    up]`, N rows each): BLOCK_N // 2 gate rows from tile * BLOCK_N // 2, then their up rows. Past
    the end, the last gate (or up) row is read (any row would do: those sums are not stored)."""
    if GATED:
        HALF: gl.constexpr = BLOCK_N // 2
        row = gl.program_id(0) * HALF + r % HALF
        rows = gl.minimum(row, N - 1) + N * (r // HALF)
    else:
        row = gl.program_id(0) * BLOCK_N + r
        rows = gl.minimum(row, N - 1)
    return rows.to(gl.int64), row < N


@gluon.jit
def _int4_mma_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, partial_ptr, count_ptr, N, w_row_stride,
    scale_row_stride, scale_col_stride, zero_row_stride, zero_col_stride, words_per_split,
    BLOCK_N: gl.constexpr, WARPS: gl.constexpr, GROUPS: gl.constexpr, SPLITS: gl.constexpr,
    SPLIT_GROUPS: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, F16: gl.constexpr,
    GATED: gl.constexpr, GELU_TANH: gl.constexpr, PDL: gl.constexpr, words: gl.constexpr,
    x_layout: gl.constexpr,
):  # fmt: skip
    """Program (tile, split): the split's `words_per_split` words of each of the tile's rows
    (`_weight_rows`; `w_ptr` int32 words, `w_row_stride` of them a row), GROUPS groups a step,
    the next step's words loaded before this step's are summed; the tile's SPLITS parts summed by
    its last program (`_sum_splits_in_the_last`, or GATED `_gated_in_the_last`: N output rows of a
    2N-row weight). Under PDL the first words are read before the wait (no kernel writes a
    weight). `words`, `x_layout`: `_layouts`."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    STEP: gl.constexpr = 16 * GROUPS  # a row's words a step
    word_start = gl.program_id(1) * words_per_split
    end = word_start + words_per_split
    rows, _ = _weight_rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words)), N, GATED, BLOCK_N)
    column = gl.arange(0, STEP, layout=gl.SliceLayout(0, words))
    w_ptrs = w_ptr + rows[:, None] * w_row_stride + word_start + column[None, :]
    w = gl.load(w_ptrs)
    _await_inputs(PDL)
    x_smem, sum_smem = _stage_x(x_ptr, word_start, words_per_split, WARPS, SPLIT_GROUPS)
    read_rows, stored = _weight_rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma)), N, GATED, BLOCK_N)
    scale_ptrs = scale_ptr + read_rows * scale_row_stride
    zero_ptrs = zero_ptr + read_rows * zero_row_stride
    acc = gl.zeros([BLOCK_N, 8], gl.float32, layout=mma)
    for word in range(word_start, end, STEP):
        w_next = gl.load(w_ptrs + STEP, mask=word + STEP < end, other=0)
        group = word // 16
        local = (word - word_start) // 16
        scales_now = scale_ptrs + group * scale_col_stride
        zeros_now = zero_ptrs + group * zero_col_stride
        if GROUPS == 1:
            acc += _group_sum(w, local, scales_now, zeros_now, x_smem, sum_smem, mma, x_layout, BLOCK_N,
                              HAS_ZEROS, F16)  # fmt: skip
        else:
            w0, w1 = gl.split(gl.permute(gl.reshape(w, [BLOCK_N, 2, 16]), [0, 2, 1]))
            acc += _group_sum(w0, local, scales_now, zeros_now, x_smem, sum_smem, mma, x_layout, BLOCK_N,
                              HAS_ZEROS, F16)  # fmt: skip
            acc += _group_sum(w1, local + 1, scales_now + scale_col_stride, zeros_now + zero_col_stride,
                              x_smem, sum_smem, mma, x_layout, BLOCK_N, HAS_ZEROS, F16)  # fmt: skip
        w = w_next
        w_ptrs += STEP
    columns = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    y = gl.sum(gl.where((columns == 0)[None, :], acc, 0.0), axis=1)
    if GATED:
        _gated_in_the_last(y, read_rows, stored, partial_ptr, bias_ptr, out_ptr, count_ptr, N, SPLITS,
                           HAS_BIAS, GELU_TANH, BLOCK_N, WARPS)  # fmt: skip
    else:
        _sum_splits_in_the_last(y, partial_ptr, bias_ptr, out_ptr, count_ptr, N, SPLITS, HAS_BIAS, BLOCK_N,
                                WARPS)  # fmt: skip


def _layouts(block_n: int, warps: int, groups: int) -> tuple:
    """The words' layout (thread (lane l, warp w): rows 16 warps t + 16 w + 8 h + l // 4, h and t
    its registers, words 4 (l % 4) .. + 3 of each group: the left operand's fragments) and x's
    (`[8, 4, 32]`: lane c's 32 columns of a group, in every lane of c and every warp)."""
    warp_bits = warps.bit_length() - 1
    repeat_bits = (block_n // (16 * warps)).bit_length() - 1
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]]
        + [[16 * warps << t, 0] for t in range(repeat_bits)]
        + [[0, 16 << g] for g in range(groups.bit_length() - 1)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(warp_bits)],
        block_bases=[],
        shape=[block_n, 16 * groups],
    )
    x_layout = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0]] * warp_bits,
        block_bases=[],
        shape=[8, 4, 32],
    )
    return words, x_layout


def mma_gemv_applies(x: torch.Tensor, group_size: int, K: int) -> bool:
    """Whether `int4_mma_gemv` takes this product: bf16 or fp16 x on a CUDA device with bf16
    `mma.sync` (sm_80 on), groups of 128."""
    half = x.dtype in (torch.bfloat16, torch.float16)
    shape = group_size == _GROUP and K % _GROUP == 0
    return x.is_cuda and half and shape and torch.cuda.get_device_capability(x.device) >= (8, 0)


def int4_mma_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    config: dict | None = None,
    split_k: int | None = None,
    activation: str | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """`out` `[1, N]` = `x` `[1, K]` @ W.T + bias for `int4_layout`'s W in groups of 128
    (`mma_gemv_applies`); with `activation` ("silu" or "gelu_tanh"), W is `[gate; up]` and `out`
    `[1, N // 2]` is `act(gate) * up` (gemv.gated's `int4_gated_gemv`). `config` (BLOCK_N rows
    and WARPS warps a program) and `split_k` (a divisor of the steps) override the tiles and the K
    splits; `pdl` launches it with programmatic dependent launch where the device has it."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    gated = activation is not None
    groups_a_row = K // _GROUP
    groups_a_step = 2 if groups_a_row % 2 == 0 else 1
    config = config or _int4_mma_config(N // 2 if gated else N)
    block_n, warps = config["BLOCK_N"], config["WARPS"]
    if block_n % (16 * warps):
        raise ValueError(f"{block_n} rows are not whole tiles of 16 rows for each of {warps} warps")
    tiles = triton.cdiv(N // 2 if gated else N, block_n // 2 if gated else block_n)
    splits = split_k or _int4_mma_splits(tiles, groups_a_row, groups_a_step, num_sms(x.device))
    if groups_a_row % (splits * groups_a_step):
        raise ValueError(f"K = {K} is not {splits} splits of whole steps of {groups_a_step} groups")
    words = qweight.view(torch.int32)
    # Gated, the parts go through memory even unsplit: the last program pairs each gate row's
    # sums with its up row's, which other threads hold.
    counted = splits > 1 or gated
    partial = torch.empty((splits, N), dtype=torch.float32, device=x.device) if counted else out
    counts = split_counts(x.device, tiles) if counted else out
    if counts is None:
        raise ValueError(f"{tiles} tiles: more than split_counts holds")
    layouts = _layouts(block_n, warps, groups_a_step)
    _int4_mma_gemv_kernel[(tiles, splits)](
        x,
        words,
        scales,
        scales if zeros is None else zeros,
        out if bias is None else bias,  # any pointer where there is no bias: not read
        out,
        partial,
        counts,
        N // 2 if gated else N,
        words.stride(0),
        *scales.stride(),
        *((0, 0) if zeros is None else zeros.stride()),
        K // 8 // splits,
        BLOCK_N=block_n,
        WARPS=warps,
        GROUPS=groups_a_step,
        SPLITS=splits,
        SPLIT_GROUPS=triton.next_power_of_2(groups_a_row // splits),
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        F16=x.dtype == torch.float16,
        GATED=gated,
        GELU_TANH=activation == "gelu_tanh",
        words=layouts[0],
        x_layout=layouts[1],
        num_warps=warps,
        **launch_options(x, pdl),
    )
    return out
