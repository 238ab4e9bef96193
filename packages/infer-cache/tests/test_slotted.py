"""SlottedKVCache: ContiguousKVCache's tensors, lent out one slot per request."""

import pytest
import torch

from infer.cache import (
    CacheFullError,
    ContiguousKVCache,
    DoubleFreeError,
    ForeignBlockError,
    KVCacheShape,
    KVPool,
    SlottedKVCache,
)

SHAPE = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=4, max_seq_len=8, dtype=torch.float32)


def test_layout_matches_the_contiguous_cache():
    pool = SlottedKVCache(SHAPE, num_slots=3)
    reference = ContiguousKVCache(SHAPE, num_slots=3)
    assert len(pool.kv_layers) == len(reference.kv_layers) == SHAPE.num_layers
    for (k, v), (k_ref, v_ref) in zip(pool.kv_layers, reference.kv_layers, strict=True):
        assert k.shape == v.shape == k_ref.shape == v_ref.shape == (3, 2, 8, 4)
        assert k.dtype == v.dtype == k_ref.dtype == v_ref.dtype


def test_both_pools_satisfy_the_runner_protocol():
    assert isinstance(SlottedKVCache(SHAPE, num_slots=1), KVPool)
    assert isinstance(ContiguousKVCache(SHAPE, num_slots=1), KVPool)


def test_lending_and_returning_slots():
    pool = SlottedKVCache(SHAPE, num_slots=2)
    first, second = pool.allocate("req-1"), pool.allocate("req-2")
    assert {first, second} == {0, 1}
    assert (pool.num_free, pool.num_used, pool.capacity, pool.usage_ratio) == (0, 2, 2, 1.0)
    with pytest.raises(CacheFullError):
        pool.allocate("req-3")
    pool.free(first)
    assert pool.owner_of(first) is None and pool.owner_of(second) == "req-2"
    assert pool.usage_ratio == 0.5
    with pytest.raises(DoubleFreeError):
        pool.free(first)
    with pytest.raises(ForeignBlockError):
        pool.free(2)


def test_audit_reports_slots_of_finished_requests():
    pool = SlottedKVCache(SHAPE, num_slots=3)
    leaked = pool.allocate("finished")
    pool.allocate("running")
    assert pool.audit(live_owners=["running"]) == [leaked]


def test_a_slot_is_its_own_memory():
    # Writing one request's keys must not touch another slot: the runner relies on it when it
    # scatters a batch's new keys by slot id.
    pool = SlottedKVCache(SHAPE, num_slots=3)
    slot = pool.allocate("req")
    k_cache, _ = pool.kv_layers[0]
    k_cache[slot] = 1.0
    untouched = [s for s in range(3) if s != slot]
    assert torch.count_nonzero(k_cache[untouched]) == 0
    assert torch.all(k_cache[slot] == 1.0)
