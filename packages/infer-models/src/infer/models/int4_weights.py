"""4-bit weights in the layout of infer.kernels.gemv.int4_layout: repacked from GPTQ and AWQ checkpoint
tensors, quantized from dense weights at load, and packed back into the published layouts (for
random checkpoints, infer.models.random_checkpoint).

Our layout (`Int4Weight`): `qweight` `[N, K // 2]` uint8 (column 2j in byte j's low nibble),
`scales` and `zeros` `[N, K // group_size]` (zeros None: symmetric, every zero point 8), and
`perm`, GPTQ act-order's column order (None: the columns as they are); the Linear computes
`x[..., perm] @ W.T` with `W[n, k] = (q[n, k] - zero) * scale` of the permuted columns.

The published layouts (each tensor int32 words of 8 values, the lowest bits first), as GPTQModel
2.2.0 (`BaseQuantLinear.dequantize_weight`) and AutoAWQ 0.2.9 (`awq/utils/packing_utils.py`,
`dequantize_gemm`) read them:
- GPTQ: `qweight` `[K // 8, N]`, packed along K; `qzeros` `[G, N // 8]` and `scales` `[G, N]`,
  one row per group; `g_idx` `[K]`, the group of each column (act-order: not sorted). In the v1
  format (`checkpoint_format: "gptq"`) the stored zero points are the true ones minus 1.
- AWQ (gemm): `qweight` `[K, N // 8]`, packed along N, the word's nibbles holding the columns
  [0, 2, 4, 6, 1, 3, 5, 7] of its eight; `qzeros` `[G, N // 8]` packed the same way; `scales`
  `[G, N]`.

Each function works on one tensor, in chunks of output rows of at most
quantization.QUANTIZE_CHUNK_BYTES of float32 (or int32) temporaries (`row_chunks`), so that
loading peaks near the packed footprint.
"""

from dataclasses import dataclass

import torch

from infer.kernels.gemv.int4_layout import SYMMETRIC_ZERO, pack_int4
from infer.models.quantization import row_chunks

# The values in a packed int32 word and their shifts, lowest bits first.
PACK_FACTOR = 8
_SHIFTS = tuple(range(0, 32, 4))
# AWQ's order of the eight columns in a word's nibbles, and its inverse: column j sits in nibble
# AWQ_REVERSE_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
QMAX = 15


class Int4FormatError(ValueError):
    """Checkpoint tensors that are not a 4-bit weight of the declared format."""


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # [N, K // 2] uint8
    scales: torch.Tensor  # [N, K // group_size]
    zeros: torch.Tensor | None  # [N, K // group_size] uint8, or None: symmetric (zero 8)
    perm: torch.Tensor | None = None  # [K] int64: the columns' order (act-order), or None


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 `[..., W]` -> `[..., W, 8]` values 0..15, the word's lowest bits first."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _pack_words(values: torch.Tensor) -> torch.Tensor:
    """`_unpack_words`' inverse: `[..., W, 8]` values 0..15 -> int32 `[..., W]` (two's complement)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device)
    return (values.to(torch.int64) << shifts).sum(-1).to(torch.int32)


def _check_zeros(zeros: torch.Tensor, symmetric: bool, what: str) -> torch.Tensor | None:
    if zeros.max().item() > QMAX:
        raise Int4FormatError(
            f"{what}: a zero point above {QMAX} (a GPTQ v1 checkpoint's stored 15 means 16, which 4 "
            "bits cannot hold)"
        )
    if not symmetric:
        return zeros
    if (zeros != SYMMETRIC_ZERO).any():
        raise Int4FormatError(
            f"{what}: the checkpoint is symmetric (sym) but a zero point is not {SYMMETRIC_ZERO}"
        )
    return None


def act_order_permutation(g_idx: torch.Tensor, group_size: int, what: str) -> torch.Tensor | None:
    """The column order that makes GPTQ's groups contiguous (`g_idx[perm]` = 0, ..., 0, 1, ...),
    or None where the columns are in it already. Each group must hold `group_size` columns."""
    in_features = g_idx.shape[0]
    natural = torch.arange(in_features, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), natural):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], natural):
        raise Int4FormatError(f"{what}: g_idx does not put {group_size} columns in each group")
    return perm


def repack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    *,
    zero_offset: int,
    symmetric: bool,
    what: str = "gptq weight",
) -> Int4Weight:
    """One GPTQ Linear's tensors (see the module) in our layout, its columns sorted by `g_idx`."""
    in_features, out_features = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    perm = None if g_idx is None else act_order_permutation(g_idx, group_size, what)
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=qweight.device)
    for first, last in row_chunks(out_features, in_features * 4):
        # [K // 8, n, 8] -> [K, n]: value j of word i is column 8i + j.
        q = _unpack_words(qweight[:, first:last]).permute(0, 2, 1).reshape(in_features, last - first).t()
        packed[first:last] = pack_int4(q if perm is None else q[:, perm])
    # [G, N // 8, 8] -> [G, N] -> [N, G]; v1 stored each zero point minus 1.
    zeros = _unpack_words(qzeros).reshape(qzeros.shape[0], -1)[:, :out_features].t() + zero_offset
    return Int4Weight(packed, scales.t().contiguous(), _check_zeros(zeros, symmetric, what), perm)


def repack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, what: str = "awq weight"
) -> Int4Weight:
    """One AWQ (gemm) Linear's tensors (see the module) in our layout."""
    in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    reverse = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=qweight.device)
    for first, last in row_chunks(out_features // PACK_FACTOR, in_features * 4 * PACK_FACTOR):
        q = _unpack_words(qweight[:, first:last])[..., reverse].reshape(in_features, -1).t()
        packed[first * PACK_FACTOR : last * PACK_FACTOR] = pack_int4(q)
    zeros = _unpack_words(qzeros)[..., reverse].reshape(qzeros.shape[0], -1).t().contiguous()
    return Int4Weight(packed, scales.t().contiguous(), _check_zeros(zeros, False, what))


def _round_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` (float32, positive) in `dtype`, rounded up where rounding to nearest would shrink
    it: the group's range then fits 15 steps of the stored scale."""
    stored = scale.to(dtype)
    if dtype.itemsize == 4:
        return stored
    # The next value of a positive half-precision float is its bits plus one (any device).
    next_up = (stored.view(torch.int16) + 1).view(dtype)
    return torch.where(stored.float() < scale, next_up, stored)


def _quantize_rows(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, in_features = weight.shape
    groups = weight.float().view(rows, in_features // group_size, group_size)
    if symmetric:  # GPTQ's sym: [-absmax, absmax] over 15 steps, zero 8 (the +8 end clamps to 7)
        absmax = groups.abs().amax(-1)
        low, high = -absmax, absmax
    else:  # the group's range, widened to hold 0, so that the zero point is in 0..15
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (high - low) / QMAX
    scale = _round_up(torch.where(scale > 0, scale, torch.ones_like(scale)), scale_dtype)
    if symmetric:
        zero = torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        zero = (-low / scale.float()).round().clamp(0, QMAX)
    q = ((groups / scale.float()[..., None]).round() + zero[..., None]).clamp(0, QMAX)
    return q.view(rows, in_features).to(torch.uint8), scale, zero.to(torch.uint8)


def quantize_int4(
    weight: torch.Tensor,
    group_size: int,
    scale_dtype: torch.dtype,
    *,
    symmetric: bool = False,
    device: torch.device | str | None = None,
) -> Int4Weight:
    """A dense `[N, K]` weight rounded to nearest on a 4-bit grid per group of `group_size` columns.

    Asymmetric (the default): each group's range [min, max] (widened to hold 0) is split into 15
    steps, scale = (max - min) / 15, with a zero point round(-min / scale). At 4 bits this is
    lower error than symmetric absmax scaling, whose grid spends steps on the side of 0 a group
    barely reaches (and GPTQ's symmetric grid clamps the positive end to 7 steps of 7.5). Every
    weight is within half a step (scale / 2) of its dequantized value: the scale is stored in
    `scale_dtype`, rounded up where needed so that the range still fits. An all-zero group has
    scale 1. `symmetric`: GPTQ's sym grid (zero point 8), for writing such checkpoints.

    A chunk of rows at a time (QUANTIZE_CHUNK_BYTES of float32), each packed as it is made, so
    the temporaries stay bounded and the result is that of the whole weight. The result is on
    `device` (default: the weight's); a weight elsewhere (the loader's, on the host) goes there a
    chunk at a time, so the device never holds it dense."""
    device = weight.device if device is None else torch.device(device)
    rows, in_features = weight.shape
    packed = torch.empty(rows, in_features // 2, dtype=torch.uint8, device=device)
    scales, zeros = _group_tensors(weight, group_size, scale_dtype, device)
    for first, last in row_chunks(rows, in_features * 4):
        q, scales[first:last], zeros[first:last] = _quantize_rows(
            weight[first:last].to(device), group_size, scale_dtype, symmetric
        )
        packed[first:last] = pack_int4(q)
    return Int4Weight(packed, scales, None if symmetric else zeros)


def quantize_int4_unpacked(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype, *, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int4` with q left unpacked: (q `[N, K]` uint8 0..15, scales, zeros `[N, G]`), for
    the writers of the published layouts."""
    q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    scales, zeros = _group_tensors(weight, group_size, scale_dtype, weight.device)
    for first, last in row_chunks(weight.shape[0], weight.shape[1] * 4):
        q[first:last], scales[first:last], zeros[first:last] = _quantize_rows(
            weight[first:last], group_size, scale_dtype, symmetric
        )
    return q, scales, zeros


def _group_tensors(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    groups = (weight.shape[0], weight.shape[1] // group_size)
    return (
        torch.empty(groups, dtype=scale_dtype, device=device),
        torch.empty(groups, dtype=torch.uint8, device=device),
    )


def pack_gptq(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, *, zero_offset: int
) -> dict[str, torch.Tensor]:
    """A GPTQ Linear's tensors (suffix -> tensor) for `q` `[N, K]` (columns in the checkpoint's
    order), `scales`/`zeros` `[N, G]` and `g_idx` `[K]`: v1 (`zero_offset` 1) stores zeros minus 1."""
    out_features, in_features = q.shape
    if (zeros < zero_offset).any():
        raise ValueError("GPTQ's v1 format cannot store a zero point of 0 (it stores zero - 1)")
    qweight = _pack_words(
        q.t().reshape(in_features // PACK_FACTOR, PACK_FACTOR, out_features).transpose(1, 2)
    )
    stored_zeros = zeros.to(torch.int64).t() - zero_offset
    qzeros = _pack_words(stored_zeros.reshape(zeros.shape[1], out_features // PACK_FACTOR, PACK_FACTOR))
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """An AWQ (gemm) Linear's tensors (suffix -> tensor) for `q` `[N, K]`, `scales`/`zeros` `[N, G]`."""
    order = torch.tensor(AWQ_ORDER)
    out_features, in_features = q.shape
    qweight = _pack_words(q.t().reshape(in_features, out_features // PACK_FACTOR, PACK_FACTOR)[..., order])
    words = zeros.t().reshape(zeros.shape[1], out_features // PACK_FACTOR, PACK_FACTOR)[..., order]
    return {"qweight": qweight, "qzeros": _pack_words(words), "scales": scales.t().contiguous()}
