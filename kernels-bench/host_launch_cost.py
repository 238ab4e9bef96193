"""Host time of two per-step operations that are launched, not captured in a graph: greedy
argmax over a step's logits (infer-kernels' two Triton kernels against `torch.argmax`) and the
prefix cache's copy-on-write of one block in every layer (a launch per layer and tensor against
the pool's one copy over its stacked layers, `PagedKVPool.copy_blocks`).

When a serving step's host work is what the device waits for (async scheduling at 64 rows of a
1B model), each microsecond of host time here is one of the step's. Printed per operation: the
host's microseconds a call (median over calls that do not wait, the queue drained every 8
calls) and microseconds a call back to back timed with CUDA events (the device's time, unless
the host's is longer: then the host's).

    python kernels-bench/host_launch_cost.py
"""

import functools
import statistics
import time

import torch

from infer.cache import KVCacheShape, PagedKVPool
from infer.kernels.argmax import argmax

VOCAB = 128_256  # Llama 3's
CALLS = 300


def host_us(fn) -> float:
    times = []
    for i in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times[20:])


def back_to_back_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def copy_layer_by_layer(pool: PagedKVPool, src: int, dst: int) -> None:
    """The copy as PagedKVPool did it before its layers were stacked."""
    src_ids = torch.tensor((src,), dtype=torch.long).to(pool.kv_layers[0][0].device, non_blocking=True)
    dst_ids = torch.tensor((dst,), dtype=torch.long).to(pool.kv_layers[0][0].device, non_blocking=True)
    for layer in pool.layer_tensors:
        for t in layer:
            t = t.view(torch.uint8)
            t.index_copy_(0, dst_ids, t.index_select(0, src_ids))


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for rows in (1, 16, 64):
        logits = torch.randn(rows, VOCAB, device="cuda")
        for name, call in (
            ("infer argmax", functools.partial(argmax, logits)),
            ("torch.argmax", functools.partial(torch.argmax, logits, -1)),
        ):
            host, device = host_us(call), back_to_back_us(call)
            print(f"{name:13s} {rows:3d} rows: host {host:6.1f} us, back to back {device:6.1f} us")
    # Llama 3.2 1B's KV shapes.
    shape = KVCacheShape(num_layers=16, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16, block_size=16)
    pool = PagedKVPool(shape, num_blocks=16384, device="cuda")
    for name, fn in (
        ("copy a block, layer by layer", functools.partial(copy_layer_by_layer, pool, 1, 3)),
        ("copy a block, stacked", functools.partial(pool.copy_blocks, [(1, 3)])),
    ):
        print(f"{name}: host {host_us(fn):6.1f} us, back to back {back_to_back_us(fn):6.1f} us")


if __name__ == "__main__":
    main()
