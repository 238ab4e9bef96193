"""Decode against the memory roofline (infer.engine.roofline): the bytes a decode step reads,
checked against the checkpoint's own tensors and config.json, and the engine's count of them
over the decode steps that ran back to back."""

import json
import time

import pytest
import torch
from safetensors import safe_open

from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.roofline import DecodeTraffic, copy_bandwidth

GREEDY = dict(temperature=0.0, ignore_eos=True)


def checkpoint_weight_bytes(folder, itemsize: int) -> int:
    """Every tensor of the checkpoint once, but an untied input embedding (a step reads only the
    rows of its tokens): read from the safetensors files, not from our model."""
    shapes = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is no mapping
                shapes[name] = tensors.get_slice(name).get_shape()
    embedding = next(name for name in shapes if name.endswith("embed_tokens.weight"))
    if "lm_head.weight" in shapes:
        del shapes[embedding]
    return sum(torch.Size(shape).numel() for shape in shapes.values()) * itemsize


def brute_force_kv_bytes(folder, context_lens: list[int], itemsize: int) -> int:
    """Layer by layer from config.json: K and V of each sequence's context, or of its last
    `sliding_window` tokens in a sliding layer."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_key_value_heads"] * head_dim * itemsize
    total = 0
    for layer in range(config["num_hidden_layers"]):
        sliding = config.get("layer_types", ["full_attention"] * (layer + 1))[layer] == "sliding_attention"
        for n in context_lens:
            total += per_token * (min(n, config["sliding_window"]) if sliding else n)
    return total


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_a_decode_step_reads_each_weight_once_and_each_sequence_kv(preset, tiny_models, tiny_checkpoints):
    model, folder = tiny_models[preset].loaded.model, tiny_checkpoints[preset]
    traffic = DecodeTraffic.of(model, torch.float32)
    weights = checkpoint_weight_bytes(folder, itemsize=4)
    assert traffic.step_bytes([]) == weights
    # Contexts shorter and longer than gemma3-tiny's sliding window.
    for lens in ([1], [7, 300], [40, 40, 513]):
        assert traffic.step_bytes(lens) == weights + brute_force_kv_bytes(folder, lens, itemsize=4), lens


def test_the_engine_counts_the_decode_steps_that_ran_back_to_back(tiny_models):
    loaded = tiny_models["gemma3-tiny"].loaded
    config = EngineConfig(max_batch_size=2, max_seq_len=256, block_size=4, async_scheduling=False)
    engine = Engine(config, loaded_model=loaded)
    prompt_lens, new_tokens = (9, 20), 12
    for n in prompt_lens:
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_new_tokens=new_tokens, **GREEDY))
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    wall_s = time.perf_counter() - started
    stats = engine.core.stats()
    # Step 1 prefills both prompts (and samples their first tokens); steps 2..12 each decode one
    # token of both. Each decode step but the last is counted, with the time to the next one.
    traffic = engine.core.decode_traffic
    expected = sum(traffic.step_bytes([n + k for n in prompt_lens]) for k in range(1, new_tokens - 1))
    assert stats.decode_bytes_total == expected
    assert 0 < stats.decode_time_s_total < wall_s
    assert stats.copy_bandwidth_bytes_per_s == copy_bandwidth(torch.device("cpu")) > 1e9
    engine.shutdown()
