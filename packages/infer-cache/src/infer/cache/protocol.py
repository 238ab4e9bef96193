"""What the engine's runner needs from any KV pool, whichever layout it has.

The runner builds a ForwardBatch from `kv_layers` and sizes memory with `kv_bytes`; it never
asks which pool it holds (STYLE: "Cache pools satisfy one protocol").
"""

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from infer.cache.contiguous import KVCacheShape


@runtime_checkable
class KVPool(Protocol):
    # The model's KV geometry and dtype (max_seq_len: the longest sequence one slot holds).
    shape: KVCacheShape

    # Per layer (k_cache, v_cache); the layout is the pool's, ForwardBatch documents the one the
    # models read today: [num_slots, num_kv_heads, max_seq_len, head_dim].
    @property
    def kv_layers(self) -> Sequence[tuple[torch.Tensor, torch.Tensor]]: ...

    # Bytes held by every K and V tensor together.
    @property
    def kv_bytes(self) -> int: ...
