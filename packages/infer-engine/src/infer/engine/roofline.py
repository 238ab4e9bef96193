"""Decode against the memory roofline: the bytes a decode step must read, and the device's
measured copy bandwidth, so that a decode step's time can be compared with the fastest it could be.

A decode step of a small batch is bound by memory: it reads every weight once (the input
embedding only by the rows of its tokens, unless the LM head shares it) and each sequence's K/V
(a sliding-window layer only its last `window` tokens), and computes little on them. Its floor is
those bytes over the bandwidth the device really gives, which `copy_bandwidth` measures with a
large device-to-device copy (bytes read plus written, over its time), as kernels-bench does. Over
a stretch of decode steps, bytes read over time taken, divided by that bandwidth, is the share of
the roofline the engine reaches (issue 15's measure; the dashboard's "% of memory roofline").
"""

import functools
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from infer.cache import KVCacheShape

# Large enough that no cache holds it (the H100's L2 is 50 MB; a CPU's L3 up to a few hundred MB
# on big servers is rare on the machines this runs on) and small enough to borrow at start-up.
COPY_BYTES = {"cuda": 256 * 2**20, "cpu": 128 * 2**20}
COPY_REPEATS = 7
# An idle GPU may run its first milliseconds of work at low clocks (one H100 process measured
# 2528 GB/s where the next ones, right after other work, measured 2884): copies run this long
# before any is timed.
WARM_UP_S = {"cuda": 0.2}


@functools.cache
def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a `copy_` of a large tensor moves on `device` (read + written), the median
    of a few (a shared machine's odd fast or slow run moves it least); measured once per process
    and device."""
    device = torch.device(device)
    numel = COPY_BYTES.get(device.type, COPY_BYTES["cpu"]) // 4
    seconds = _median_copy_s(numel, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the buffers back before the KV pool is sized
    return 2 * numel * 4 / seconds


def _median_copy_s(numel: int, device: torch.device) -> float:
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    # Warm: the pages' first touch, the kernel's first launch, and the device's clocks.
    warm_until = time.perf_counter() + WARM_UP_S.get(device.type, 0.0)
    while True:
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() >= warm_until:
            break
    times = []
    for _ in range(COPY_REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - started
        times.append(seconds)
    return statistics.median(times)


@dataclass(frozen=True)
class DecodeTraffic:
    """The bytes a decode step reads: `weight_bytes` once, and per sequence the K/V of its
    context: for each (window, bytes) of `kv_bytes_per_token`, `bytes` per token of at most
    `window` tokens (None: all of them). Layers that read alike are summed into one pair."""

    weight_bytes: int
    kv_bytes_per_token: tuple[tuple[int | None, int], ...]

    @classmethod
    def of(cls, model: torch.nn.Module, kv_dtype: torch.dtype) -> "DecodeTraffic":
        """For one of infer.models' CausalLMs (its `embed_tokens`, `lm_head` and `config`)."""
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        embedding = model.embed_tokens.weight
        if model.lm_head.weight is not embedding:  # an untied table: a step reads a row per token
            weight_bytes -= embedding.numel() * embedding.element_size()
        config = model.config
        # A token's K and V in one layer, as the pool stores them (an fp8 cache's scale bytes too).
        layer_bytes = KVCacheShape(1, config.num_kv_heads, config.head_dim, kv_dtype, 1).bytes_per_token()
        by_window: dict[int | None, int] = {}
        for layer in range(config.num_layers):
            window = config.sliding_window_for_layer(layer)
            by_window[window] = by_window.get(window, 0) + layer_bytes
        return cls(weight_bytes, tuple(by_window.items()))

    def step_bytes(self, context_lens: Iterable[int]) -> int:
        """Bytes read by one decode step of sequences with these context lengths (each counting
        the token it decodes, whose K/V the step writes and reads)."""
        lens = list(context_lens)
        total = self.weight_bytes
        for window, per_token in self.kv_bytes_per_token:
            total += per_token * (sum(lens) if window is None else sum(min(n, window) for n in lens))
        return total
