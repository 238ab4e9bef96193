"""KVCacheShape: the geometry of one model's KV cache, and the memory arithmetic on it.

One token's KV is a K and a V vector per layer and KV head: 2 * num_layers * num_kv_heads *
head_dim elements of `dtype`, and with the fp8 cache (float8_e4m3fn, infer.kernels.kv_fp8) one
scale byte per vector besides. A block is `block_size` tokens, the unit a pool lends out.
"""

import operator
from dataclasses import dataclass

import torch

# The fp8 cache's values (infer.kernels.kv_fp8 holds the format; this package imports only torch).
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # Tokens per block; a "contiguous" (slotted) cache is block_size = max_seq_len.
    block_size: int

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _check_positive(name, getattr(self, name))
        if not hasattr(self.dtype, "itemsize"):
            raise ValueError(f"dtype must be a torch.dtype such as torch.bfloat16, got {self.dtype!r}")

    @property
    def is_fp8(self) -> bool:
        """Values in float8_e4m3fn, each vector with a scale byte (infer.kernels.kv_fp8)."""
        return self.dtype == FP8_DTYPE

    def bytes_per_token(self) -> int:
        """K and V of one token, every layer and KV head (with their scale bytes in fp8)."""
        vector_bytes = self.head_dim * self.dtype.itemsize + (1 if self.is_fp8 else 0)
        return 2 * self.num_layers * self.num_kv_heads * vector_bytes

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of K and V for exactly `num_tokens` tokens (not rounded up to whole blocks)."""
        _check_count("num_tokens", num_tokens)
        return self.bytes_per_token() * num_tokens

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size); 0 for 0."""
        _check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)


def _check_positive(name: str, value) -> None:
    _check_count(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_count(name: str, value) -> None:
    try:
        operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
