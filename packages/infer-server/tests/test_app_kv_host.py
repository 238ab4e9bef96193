"""The host KV tier (kv_host_cache_gib) through a real server: SmolLM2 with a KV pool of 12 blocks
of 4 tokens and a host tier of 8 blocks gets three prompts of 24 tokens, then each again with 5
more. The pool cannot hold them all: evicted blocks go to host memory, come back for the
follow-ups' hits, and the full tier drops its oldest. /metrics and /v1/stats give the bytes the
engine's prefix tree counted, block by block, times a block's bytes worked out from the model's
shape. A server whose second tier is int8 on the device has neither the metrics nor the section."""

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

BLOCK_SIZE = 4
HOST_BLOCKS = 8
KV_HOST_METRICS = {
    "infer_kv_host_cache_bytes": "gauge",
    "infer_kv_host_cache_budget_bytes": "gauge",
    "infer_kv_host_offloaded_bytes": "counter",
    "infer_kv_host_restored_bytes": "counter",
    "infer_kv_host_dropped_bytes": "counter",
    "infer_kv_host_transfer_seconds": "counter",
}  # as prometheus_client names the families (a counter's without _total)


def block_bytes(config) -> int:
    """A KV block's bytes from the model's shape: K and V of every layer, in float32."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * BLOCK_SIZE * 4


def small_pool(**config) -> dict:
    """EngineConfig fields for a KV pool of 12 blocks, too small for the conversations."""
    return dict(max_seq_len=128, max_batch_size=4, block_size=BLOCK_SIZE, num_gpu_blocks=12, **config)


def start_host_tier_server(start_server, model_config):
    """A server whose prefix cache has a host tier of HOST_BLOCKS blocks."""
    gib = HOST_BLOCKS * block_bytes(model_config) / 2**30  # exact: a power of two apart
    return start_server(**small_pool(use_prefix_caching=True, kv_host_cache_gib=gib))


def run_conversations(server) -> None:
    """Three prompts of 24 random token ids, then each again with 5 more, one after the other
    (greedy and ignoring EOS: every run evicts and hits alike)."""
    rng = random.Random(4)
    prompts = [[rng.randrange(1000, 40000) for _ in range(24)] for _ in range(3)]
    follow_ups = [prompt + [rng.randrange(1000, 40000) for _ in range(5)] for prompt in prompts]
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        for prompt, max_tokens in [*((p, 4) for p in prompts), *((p, 6) for p in follow_ups)]:
            body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            assert client.post("/v1/completions", json=body).status_code == 200


def tree_figures(server, model_config) -> dict:
    """/v1/stats' kv_host section as the engine's own prefix tree and KV manager count it."""
    core, block = server.engine.core, block_bytes(model_config)
    tree = core.prefix_tree
    return {
        "blocks": tree.num_stored_blocks,
        "bytes": tree.num_stored_blocks * block,
        "budget_bytes": HOST_BLOCKS * block,
        "offloaded_bytes": tree.num_offloaded_total * block,
        "restored_bytes": tree.num_restored_total * block,
        "dropped_bytes": tree.num_dropped_total * block,
        "transfer_time_s": core.scheduler.kv_manager.store_transfer_s,
    }


def read(server) -> tuple[dict, dict, dict[str, str]]:
    """/v1/stats, /metrics' samples by name, and /metrics' family kinds by name."""
    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        snapshot = client.get("/v1/stats").json()
        families = list(text_string_to_metric_families(client.get("/metrics").text))
    samples = {sample.name: sample.value for family in families for sample in family.samples}
    return snapshot, samples, {family.name: family.type for family in families}


@pytest.fixture(scope="module")
def host_tier_server(start_server, smollm2_loaded):
    server = start_host_tier_server(start_server, smollm2_loaded.config)
    run_conversations(server)
    return server


def test_metrics_and_stats_give_the_bytes_the_engines_prefix_tree_moved(host_tier_server, smollm2_loaded):
    expected = tree_figures(host_tier_server, smollm2_loaded.config)
    snapshot, samples, kinds = read(host_tier_server)
    # The workload exercises every path: offloads, restores for the follow-ups, drops when full.
    assert expected["offloaded_bytes"] and expected["restored_bytes"] and expected["dropped_bytes"]
    assert expected["transfer_time_s"] > 0
    assert snapshot["prefix_cache_store"] == "host"
    assert snapshot["kv_host"] == expected
    assert {name: kinds[name] for name in KV_HOST_METRICS} == KV_HOST_METRICS
    assert {
        "held": samples["infer_kv_host_cache_bytes"],
        "budget": samples["infer_kv_host_cache_budget_bytes"],
        "offloaded": samples["infer_kv_host_offloaded_bytes_total"],
        "restored": samples["infer_kv_host_restored_bytes_total"],
        "dropped": samples["infer_kv_host_dropped_bytes_total"],
        "seconds": samples["infer_kv_host_transfer_seconds_total"],
    } == {
        "held": expected["bytes"],
        "budget": expected["budget_bytes"],
        "offloaded": expected["offloaded_bytes"],
        "restored": expected["restored_bytes"],
        "dropped": expected["dropped_bytes"],
        "seconds": expected["transfer_time_s"],
    }
    # Each second's copies add up to the totals (the server started within the history's window).
    history = snapshot["history"]
    for direction in ("offloaded", "restored"):
        per_second = history[f"kv_host_{direction}_bytes_per_s"]
        assert sum(value for _, value in per_second) == expected[f"{direction}_bytes"], direction


def test_a_server_without_a_host_tier_has_no_host_metrics_and_a_null_section(start_server):
    """The int8 store on the device is a second tier too, but not in host memory."""
    server = start_server(
        **small_pool(use_prefix_caching=True, prefix_cache_kv_bits=8, prefix_cache_quantize_min_tokens=16)
    )
    run_conversations(server)
    snapshot, samples, _ = read(server)
    assert (
        snapshot["prefix_cache_store"] == "int8" and samples["infer_prefix_cache_quantized_blocks_total"] > 0
    )
    assert snapshot["kv_host"] is None
    assert not [name for name in samples if name.startswith("infer_kv_host")]
    for direction in ("offloaded", "restored"):
        assert {value for _, value in snapshot["history"][f"kv_host_{direction}_bytes_per_s"]} == {0}
