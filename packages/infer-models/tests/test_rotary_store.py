"""RotaryEmbedding on a CPU (its own path there: the rows gathered once per forward): q and k as
the public ops give them. The CPU's KV cache writer is attention's store_kv (infer.models.attention),
so the rotation refuses a KVStore there."""

import pytest
import torch

from infer.kernels import KVStore, qk_norm_rope, rope, rope_tables
from infer.models.common import RMSNorm, RotaryEmbedding
from infer.models.config import RopeConfig

HEAD_DIM, MAX_POSITIONS = 64, 128


def make_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(5, 4, HEAD_DIM, generator=gen)
    k = torch.randn(5, 2, HEAD_DIM, generator=gen)
    v = torch.randn(5, 2, HEAD_DIM, generator=gen)
    positions = torch.randint(0, MAX_POSITIONS, (5,), generator=gen)
    caches = [torch.randn(4, 3, 2, HEAD_DIM, generator=gen) for _ in range(2)]
    slots = torch.randperm(12, generator=gen)[:5]
    return q, k, v, positions, caches, slots


def norms():
    gen = torch.Generator().manual_seed(1)
    pair = [RMSNorm(HEAD_DIM, 1e-6, offset=1.0) for _ in range(2)]
    for norm in pair:
        norm.weight.data = torch.randn(HEAD_DIM, generator=gen)
    return pair


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cpu_rotation_gives_the_ops_results_and_refuses_to_write_the_cache(qk_norm):
    q, k, v, positions, (k_cache, v_cache), slots = make_inputs()
    cos, sin = rope_tables(HEAD_DIM, MAX_POSITIONS, 10000.0)
    expected_q, expected_k = q.clone(), k.clone()
    q_norm, k_norm = norms()
    if qk_norm:
        weights = (q_norm.weight.data, k_norm.weight.data)
        qk_norm_rope(expected_q, expected_k, *weights, 1e-6, cos, sin, positions, offset=1.0)
    else:
        rope(expected_q, expected_k, cos, sin, positions)

    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, RopeConfig(theta=10000.0))
    store = KVStore(v, k_cache, v_cache, slots)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="store_kv"):
            if qk_norm:
                rotary.normalize_and_rotate(q.clone(), k.clone(), q_norm, k_norm, positions, store)
            else:
                rotary(q.clone(), k.clone(), positions, store)
        if qk_norm:
            q, k = rotary.normalize_and_rotate(q, k, q_norm, k_norm, positions)
        else:
            rotary(q, k, positions)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
