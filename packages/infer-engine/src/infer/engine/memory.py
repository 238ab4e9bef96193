"""What the engine's memory holds, for the dashboard's memory panel (EngineStats.weights_bytes and
memory_*): the model's weights, counted once when the engine is built, and the device's memory
in use, read at most once a second. The KV pool's bytes are the pool's own; the rest (activations,
CUDA graphs' pools, the allocator's slack) is what is in use beyond weights and KV.

On CUDA the figures are the caching allocator's: `torch.cuda.memory_allocated` (tensors alive)
and `memory_reserved` (what the allocator holds from the driver, alive or cached). On a CPU
nothing tells a tensor's bytes from the rest of the process, so the figure is the process's
resident set (`/proc/self/statm`): everything the process holds (Python, libraries, the server
when the core shares its process), but no page that was never touched.
"""

import os
import time

import torch

# A step takes milliseconds and torch.cuda.memory_stats builds a dict of every allocator
# counter on each call; the dashboard draws one point a second.
READ_PERIOD_S = 1.0


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once: a tied embedding and LM head
    count once, and a parameter that views part of a larger tensor counts the memory it keeps."""
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def resident_bytes() -> int:
    """The process's resident set size (bytes), 0 where /proc is missing (not Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class DeviceMemory:
    """The memory figures of EngineStats for one device, read at most once per READ_PERIOD_S."""

    def __init__(self, device: torch.device, *, clock=time.monotonic):
        self.device = torch.device(device)
        self.clock = clock
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        else:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self._total_bytes = total
        self._read_s = -float("inf")
        self._figures: dict = {}

    def stats(self) -> dict:
        """EngineStats' memory fields: memory_device ("cuda" or "cpu"), memory_used_bytes
        (CUDA: allocated; CPU: the process's resident set), memory_reserved_bytes (CUDA only:
        held by the allocator; 0 on a CPU), memory_total_bytes (the device's, or the machine's RAM)."""
        now = self.clock()
        if now - self._read_s >= READ_PERIOD_S:
            self._read_s = now
            if self.device.type == "cuda":
                used = torch.cuda.memory_allocated(self.device)
                reserved = torch.cuda.memory_reserved(self.device)
            else:
                used, reserved = resident_bytes(), 0
            self._figures = dict(
                memory_device=self.device.type,
                memory_used_bytes=used,
                memory_reserved_bytes=reserved,
                memory_total_bytes=self._total_bytes,
            )
        return self._figures
