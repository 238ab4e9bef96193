"""HostKVStore against the pool's own blocks: a block offloaded into host memory and restored
into another block is bit for bit what was offloaded, whatever order the slots come in; and the
copies keep the order of the operations around them (a block's next owner writes it after the
offload read it; a slot taken again is written after the restore read it)."""

import pytest
import torch

from infer.cache import COPY, OFFLOAD, RESTORE, HostKVStore, KVCacheShape, PagedKVPool

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def filled_pool(device: str, dtype=torch.bfloat16, num_blocks: int = 8, num_slots: int = 6) -> PagedKVPool:
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype, block_size=4)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    store = HostKVStore(shape, num_slots, pin_memory=device == "cuda")
    pool = PagedKVPool(shape, num_blocks, device, store=store)
    generator = torch.Generator().manual_seed(0)
    for t in (t.view(torch.uint8) for layer in pool.layer_tensors for t in layer):  # random bytes
        t.copy_(torch.randint(0, 256, t.shape, generator=generator, dtype=torch.uint8))
    return pool


def blocks_of(pool: PagedKVPool, blocks: list[int]) -> list[torch.Tensor]:
    """Each block's bytes: every layer's K and V, and an fp8 pool's scales."""
    return [
        torch.cat([t.view(torch.uint8)[b].flatten() for layer in pool.layer_tensors for t in layer]).cpu()
        for b in blocks
    ]


DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "slots",
    [[0, 1, 2, 3], [5, 3, 0, 1], [2, 3, 4, 5]],
    ids=["one-run", "scattered", "a-run-past-zero"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_blocks_restored_from_host_memory_are_the_blocks_offloaded(device, slots, dtype):
    pool = filled_pool(device, dtype)
    blocks = [6, 1, 4, 2]
    before = blocks_of(pool, blocks)
    pool.run_block_ops([(OFFLOAD, block, slot) for block, slot in zip(blocks, slots, strict=True)])
    for layer in pool.layer_tensors:  # the blocks' next owners write them
        for t in layer:
            t.view(torch.uint8)[blocks] = 0
    targets = [0, 3, 5, 7]
    pool.run_block_ops([(RESTORE, slot, block) for slot, block in zip(slots, targets, strict=True)])
    for block, want, got in zip(targets, before, blocks_of(pool, targets), strict=True):
        assert torch.equal(got, want), f"block {block} differs from what was offloaded"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_block_ops_keep_their_order_when_blocks_and_slots_are_taken_again(device, dtype):
    """One step's operations: block 2 goes to slot 0; slot 0 comes back into block 5; block 5 is
    copied into block 2 (copy-on-write of a match); block 3 then reuses slot 0. Every read sees
    what the operations before it wrote."""
    pool = filled_pool(device, dtype, num_slots=1)
    original = blocks_of(pool, [2, 3])
    pool.run_block_ops([(OFFLOAD, 2, 0), (RESTORE, 0, 5), (COPY, 5, 2), (OFFLOAD, 3, 0), (RESTORE, 0, 6)])
    got = blocks_of(pool, [5, 2, 6])
    assert torch.equal(got[0], original[0]) and torch.equal(got[1], original[0])
    assert torch.equal(got[2], original[1])


@pytest.mark.parametrize("device", DEVICES)
def test_many_blocks_move_through_the_staging_buffers_in_batches(device, monkeypatch):
    """Seven blocks in batches of 3 through a ring of two staging buffers, one used again."""
    monkeypatch.setattr("infer.cache.host_store.STAGING_BUFFERS", 2)
    pool = filled_pool(device, dtype=torch.float32, num_blocks=8, num_slots=8)
    pool.store.staged_blocks = 3
    blocks = [7, 6, 5, 4, 3, 2, 1]
    before = blocks_of(pool, blocks)
    pool.run_block_ops([(OFFLOAD, block, slot) for slot, block in enumerate(blocks)])
    for k, v in pool.kv_layers:
        k.zero_()
        v.zero_()
    pool.run_block_ops([(RESTORE, slot, block) for slot, block in enumerate(blocks)])
    for want, got in zip(before, blocks_of(pool, blocks), strict=True):
        assert torch.equal(got, want)


# About 0.1-0.5 s of GPU clock cycles: far longer than the copies and the launches around them.
SLEEP_CYCLES = 500_000_000


@pytest.mark.gpu
def test_an_offload_leaves_the_steps_stream_once_the_blocks_are_gathered():
    """The copy down to host memory runs on the store's offload stream: held up there (a long
    sleep queued first), it does not hold up the step's stream, whose next writes to the blocks
    still leave the slots what was offloaded."""
    pool = filled_pool("cuda")
    offload_stream, _ = pool.store.copy_streams(pool.kv_layers[0][0].device)
    blocks = [6, 1, 4]
    before = blocks_of(pool, blocks)
    pool.run_block_ops([(OFFLOAD, 0, 5)])  # once first: a first launch waits for the whole device
    offload_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(offload_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    pool.run_block_ops([(OFFLOAD, block, slot) for slot, block in enumerate(blocks)])
    for layer in pool.layer_tensors:  # the blocks' next owners write them
        for t in layer:
            t.view(torch.uint8)[blocks] = 0
    torch.cuda.current_stream().synchronize()
    assert not offload_stream.query(), "the step's stream waited for the copy to host memory"
    pool.store.synchronize()
    for slot, want in enumerate(before):
        assert torch.equal(pool.store.slots[slot], want)


@pytest.mark.gpu
def test_a_restore_held_up_on_its_stream_is_waited_for_before_the_blocks_are_read():
    pool = filled_pool("cuda")
    _, restore_stream = pool.store.copy_streams(pool.kv_layers[0][0].device)
    blocks = [6, 1, 4]
    before = blocks_of(pool, blocks)
    pool.run_block_ops([(OFFLOAD, block, slot) for slot, block in enumerate(blocks)])
    # Once first: a kernel's first launch loads its module, which waits for the whole device
    # (the restore stream's sleep too) and would hide a missing wait.
    pool.run_block_ops([(RESTORE, 0, 7)])
    restore_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(restore_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    pool.run_block_ops([(RESTORE, slot, block) for slot, block in enumerate([0, 3, 5])])
    for want, got in zip(before, blocks_of(pool, [0, 3, 5]), strict=True):  # read on the step's stream
        assert torch.equal(got, want)


def test_a_store_of_another_shape_is_refused():
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_size=4)
    other = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_size=8)
    with pytest.raises(ValueError, match="the store's blocks"):
        PagedKVPool(shape, 4, store=HostKVStore(other, 2))
    assert HostKVStore.bytes_per_slot(shape) == shape.bytes_per_block() == HostKVStore(shape, 1).nbytes
