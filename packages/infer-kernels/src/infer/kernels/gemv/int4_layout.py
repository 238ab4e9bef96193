"""The packed 4-bit weight's layout (w4a16), one for every source of 4-bit weights (GPTQ and AWQ
checkpoints, which the loader repacks, and round-to-nearest quantization at load), chosen so
that a row of W is contiguous along K, as the 8-bit GEMV streams it (gemv.quantized):

- `qweight` `[N, K // 2]` uint8: byte j of row n holds W's column 2j in its low nibble and
  column 2j + 1 in its high nibble, each an unsigned integer q in 0..15;
- `scales` `[N, K // group_size]` (float32, float16 or bfloat16): one scale per group of
  `group_size` consecutive columns of a row;
- `zeros` `[N, K // group_size]` uint8 in 0..15, one zero point per group, or None for symmetric
  weights, whose zero point is 8.

The weight the model means is `W[n, k] = (q[n, k] - zero[n, k // group_size]) * scale[n, k //
group_size]` (`dequantize_int4`, gemv.references). A GPTQ checkpoint with act-order (`desc_act`,
a `g_idx` that is not sorted) has its columns permuted by the loader so that groups are
contiguous; the caller gathers x's columns by the same permutation.
"""

import torch

# The zero point of symmetric weights (GPTQ's sym=True): q in 0..15 means q - 8 in -8..7.
SYMMETRIC_ZERO = 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`[N, K]` integers in 0..15 (any integer dtype) -> `[N, K // 2]` uint8, column 2j in byte
    j's low nibble and 2j + 1 in its high nibble."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be [N, K] with K even, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: `[N, K // 2]` uint8 -> `[N, K]` uint8 in 0..15."""
    low = qweight & 0x0F
    high = qweight >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
