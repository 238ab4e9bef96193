"""The fp8 KV cache's format: e4m3 values, one power-of-two scale per token, layer and KV head.

A token's K (or V) vector of one head is stored as `head_dim` float8_e4m3fn values q and one
uint8 byte b, the biased exponent of its scale s = 2**(b - 127), and read back as q * s. The scale
is the smallest power of two with max|x| / s <= 448 (e4m3's largest finite value), so every
element lands in e4m3's normal range down to 2**-14 of the vector's largest: each is rounded to
3 mantissa bits, within 1/16 of itself. It is computed when the token is written (`store_kv`),
from that token alone, so no request's values change another's scales; a checkpoint's static
`k_scale`/`v_scale` are not needed. The scale is a power of two (as OCP microscaling's E8M0
scales are), so scaling is exact both ways and a scale takes one byte: a token of head_dim 128
takes 129 bytes a head instead of bf16's 256, 1.98x the tokens in the same memory.

This module holds the format's arithmetic twice, for the Triton kernels that write and read the
cache (`fp8_quantize`, `fp8_scale`) and in PyTorch (`quantize_fp8_ref`, `dequantize_fp8_ref`),
bit for bit the same: the exponent is read from the float's bits, not from a log2.
"""

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_INV_FP8_MAX = 1.0 / FP8_MAX  # the same float32 on both sides: a multiply rounds alike
# Exponent bytes are clamped so that a scale and its inverse are normal float32s: an all-zero
# vector gets the smallest, and stays zero.
_MIN_BYTE, _MAX_BYTE = 1, 253


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., D]` -> (float8_e4m3fn values `[..., D]`, uint8 scale bytes `[...]`)."""
    x = x.float()
    wanted = x.abs().amax(-1) * torch.tensor(_INV_FP8_MAX, dtype=torch.float32)
    bits = wanted.view(torch.int32)
    # ceil(log2(wanted)), exactly: the biased exponent, plus one if any mantissa bit is set.
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    byte = byte.clamp(_MIN_BYTE, _MAX_BYTE)
    inverse = ((254 - byte) << 23).view(torch.float32)  # 2 ** -(byte - 127)
    q = (x * inverse.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, byte.to(torch.uint8)


def dequantize_fp8_ref(q: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_fp8_ref, in `dtype`."""
    scales = (scale_bytes.to(torch.int32) << 23).view(torch.float32)
    return (q.float() * scales.unsqueeze(-1)).to(dtype)


@triton.jit
def fp8_quantize(x, mask):
    """x `[ROWS, D]` (masked by `mask`) -> (its rows as e4m3 values, each row's scale byte):
    quantize_fp8_ref's arithmetic."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    wanted = tl.max(tl.abs(x), 1) * 0.002232142857142857  # 1 / 448, as _INV_FP8_MAX rounds
    bits = wanted.to(tl.int32, bitcast=True)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 1), 253)
    inverse = ((254 - byte) << 23).to(tl.float32, bitcast=True)
    q = tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0)
    return q.to(tl.float8e4nv), byte.to(tl.uint8)


@triton.jit
def fp8_scale(scale_bytes):
    """The float32 scales of uint8 scale bytes."""
    return (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
