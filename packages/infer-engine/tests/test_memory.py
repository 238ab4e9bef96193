"""What the engine's memory holds (infer.engine.memory): the weights' bytes against the
checkpoint's own tensors (a tied embedding and LM head once), and the memory in use against what
the OS reports of this process and machine (/proc)."""

import mmap
import time

import pytest
import torch
from safetensors import safe_open

from infer.engine import Engine, EngineConfig
from infer.engine.memory import READ_PERIOD_S, DeviceMemory, weights_bytes

TINY = ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]  # llama-tiny's LM head is its own, the others tie


def checkpoint_bytes(folder, itemsize: int) -> int:
    """Every tensor the checkpoint holds, at `itemsize` bytes an element (a tied LM head is not
    in the file: it is the embedding)."""
    numel = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is no mapping
                numel += torch.Size(tensors.get_slice(name).get_shape()).numel()
    return numel * itemsize


def proc_figure(path: str, key: str) -> int:
    """A "Key:   N kB" line of a /proc file, in bytes."""
    with open(path) as lines:
        for line in lines:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in {path}")


@pytest.mark.parametrize("preset", TINY)
def test_the_weights_are_the_checkpoints_tensors_each_once(tiny_models, tiny_checkpoints, preset):
    model = tiny_models[preset].loaded.model
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert tied == (preset != "llama-tiny")
    assert weights_bytes(model) == checkpoint_bytes(tiny_checkpoints[preset], itemsize=4)


def test_a_tied_weight_and_a_view_count_their_storage_once_and_buffers_count():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    model.part = torch.nn.Parameter(model.embed.weight.data[:5])  # a view of the same storage
    model.register_buffer("table", torch.zeros(3, 2, dtype=torch.float16))
    assert weights_bytes(model) == 10 * 4 * 4 + 3 * 2 * 2


def test_cpu_memory_is_the_process_resident_set_read_at_most_once_a_second():
    now = [0.0]
    memory = DeviceMemory(torch.device("cpu"), clock=lambda: now[0])
    before = memory.stats()
    assert before["memory_device"] == "cpu" and before["memory_reserved_bytes"] == 0
    assert before["memory_total_bytes"] == pytest.approx(proc_figure("/proc/meminfo", "MemTotal"), rel=0.01)
    assert before["memory_used_bytes"] == pytest.approx(proc_figure("/proc/self/status", "VmRSS"), rel=0.05)
    # 64 MiB of new pages, every one touched: an anonymous mapping of its own, so that no memory
    # an earlier test freed in this process serves it (the resident set must grow).
    size = 64 * 2**20
    held = mmap.mmap(-1, size)
    held.write(b"\1" * size)
    now[0] = READ_PERIOD_S / 2
    assert memory.stats() == before  # not read again yet
    now[0] = READ_PERIOD_S
    grown = memory.stats()["memory_used_bytes"] - before["memory_used_bytes"]
    held.close()
    assert grown >= 0.9 * size


def test_the_engines_statistics_carry_its_weights_and_memory(tiny_models, tiny_checkpoints):
    config = EngineConfig(max_batch_size=2, max_seq_len=128, block_size=4, async_scheduling=False)
    engine = Engine(config, loaded_model=tiny_models["qwen3-tiny"].loaded)
    try:
        time.sleep(READ_PERIOD_S)  # the reading of the engine's start has aged: stats() reads anew
        stats = engine.core.stats()
        rss = proc_figure("/proc/self/status", "VmRSS")
    finally:
        engine.shutdown()
    assert stats.weights_bytes == checkpoint_bytes(tiny_checkpoints["qwen3-tiny"], itemsize=4)
    assert stats.memory_device == "cpu"
    assert stats.memory_used_bytes == pytest.approx(rss, rel=0.05)
    assert stats.memory_used_bytes > stats.weights_bytes + stats.kv_bytes_total


@pytest.mark.gpu
def test_cuda_memory_is_the_caching_allocators(tiny_checkpoints):
    from infer.models.load import load_model

    loaded = load_model(tiny_checkpoints["qwen3-tiny"], dtype=torch.bfloat16, device="cuda")
    config = EngineConfig(max_batch_size=2, max_seq_len=128, block_size=16)
    engine = Engine(config, loaded_model=loaded)
    try:
        time.sleep(READ_PERIOD_S)
        stats = engine.core.stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    finally:
        engine.shutdown()
    assert stats.weights_bytes == checkpoint_bytes(tiny_checkpoints["qwen3-tiny"], itemsize=2)
    assert stats.memory_device == "cuda"
    assert stats.memory_used_bytes == allocated and stats.memory_reserved_bytes == reserved
    assert stats.weights_bytes + stats.kv_bytes_total <= stats.memory_used_bytes <= reserved
    assert stats.memory_total_bytes == pytest.approx(torch.cuda.mem_get_info()[1], rel=0.01)
