"""The host tier (kv_host_cache_gib) through the engine, on the CPU with a pool small enough to
evict: conversations the device pool cannot hold go to host memory, come back on a hit, and the
greedy tokens are those of an engine without any cache (the oracle: every token recomputed), for
the three architectures. No block leaks across the tiers: the pool holds only the tree's blocks
when idle, the store only its slots."""

import random
import time

import pytest

from infer.cache import HostKVStore, QuantizedKVStore
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.config import EngineConfigError

from .test_prefix_cache import GREEDY, SETTINGS, run

SMALL_POOL = {**SETTINGS, "num_gpu_blocks": 12}
GIB_FOR_SLOTS = 1 / 1024  # 1 MiB: hundreds of the tiny models' blocks


def conversations(vocab: int, seed: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of 24 tokens (7 blocks of 4 each with their answers: the pool holds 12),
    then each one again with 5 more tokens: hits on what the pool had to give up."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(24)] for _ in range(3)]
    return prompts, [prompt + [rng.randrange(vocab) for _ in range(5)] for prompt in prompts]


def num_computed(engine: Engine, request_id: str) -> int:
    request = engine.core.scheduler.get(request_id)  # None until a step takes it in
    return 0 if request is None else request.num_computed_tokens


def assert_no_leak(engine: Engine) -> None:
    core = engine.core
    tree, pool = core.prefix_tree, core.kv_pool
    assert pool.allocator.num_used == tree.num_blocks and tree.num_locked_blocks == 0
    assert pool.store.allocator.num_used == tree.num_stored_blocks


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_evicted_conversations_come_back_from_host_memory_with_the_uncached_tokens(tiny_models, name):
    model = tiny_models[name]
    plain = Engine(EngineConfig(**SMALL_POOL), loaded_model=model.loaded)
    tiered = Engine(
        EngineConfig(**SMALL_POOL, use_prefix_caching=True, kv_host_cache_gib=GIB_FOR_SLOTS),
        loaded_model=model.loaded,
    )
    assert isinstance(tiered.core.kv_pool.store, HostKVStore)
    prompts, follow_ups = conversations(model.loaded.config.vocab_size)
    for prompt in prompts:
        ((tokens, _),) = run(tiered, [prompt], max_new_tokens=4)
        assert tokens == run(plain, [prompt], max_new_tokens=4)[0][0]
    tree = tiered.core.prefix_tree
    assert tree.num_stored_blocks > 0 and tree.num_evicted_blocks == 0
    for prompt in follow_ups:
        ((tokens, num_cached),) = run(tiered, [prompt], max_new_tokens=6)
        assert num_cached >= 24, f"{num_cached} prompt tokens from the cache"
        assert tokens == run(plain, [prompt], max_new_tokens=6)[0][0]
    assert tree.num_restored_total > 0 and tree.num_evicted_blocks == 0
    assert_no_leak(tiered)
    stats = tiered.core.stats()
    block_bytes = tiered.core.kv_pool.shape.bytes_per_block()
    assert stats.prefix_cache_store == "host"
    assert stats.kv_host_bytes == tree.num_stored_blocks * block_bytes
    assert stats.kv_host_offloaded_bytes_total == tree.num_offloaded_total * block_bytes > 0
    assert stats.kv_host_restored_bytes_total == tree.num_restored_total * block_bytes > 0
    assert stats.kv_host_budget_bytes == tiered.core.kv_pool.store.num_slots * block_bytes
    assert stats.kv_host_transfer_time_s_total > 0
    for engine in (plain, tiered):
        engine.shutdown()


def test_a_full_host_tier_drops_its_oldest_blocks_and_the_tokens_stay_right(tiny_models):
    model = tiny_models["llama-tiny"]
    block_bytes = None
    plain = Engine(EngineConfig(**SMALL_POOL), loaded_model=model.loaded)
    probe = Engine(EngineConfig(**SMALL_POOL, use_prefix_caching=True), loaded_model=model.loaded)
    block_bytes = probe.core.kv_pool.shape.bytes_per_block()
    probe.shutdown()
    config = EngineConfig(**SMALL_POOL, use_prefix_caching=True, kv_host_cache_gib=4 * block_bytes / 2**30)
    tiered = Engine(config, loaded_model=model.loaded)
    assert tiered.core.kv_pool.store.num_slots == 4
    prompts, follow_ups = conversations(model.loaded.config.vocab_size, seed=5)
    for prompt in prompts:
        run(tiered, [prompt], max_new_tokens=4)
    for prompt in follow_ups:
        ((tokens, _),) = run(tiered, [prompt], max_new_tokens=6)
        assert tokens == run(plain, [prompt], max_new_tokens=6)[0][0]
    tree = tiered.core.prefix_tree
    assert tree.num_dropped_total > 0 and tree.num_stored_blocks <= 4
    assert tiered.core.stats().kv_host_dropped_bytes_total == tree.num_dropped_total * block_bytes
    assert_no_leak(tiered)
    for engine in (plain, tiered):
        engine.shutdown()


def test_a_session_idle_past_the_ttl_goes_to_host_memory_and_its_next_turn_restores_it(tiny_models):
    model = tiny_models["gemma3-tiny"]
    plain = Engine(EngineConfig(**SETTINGS), loaded_model=model.loaded)
    config = EngineConfig(
        **SETTINGS, use_prefix_caching=True, kv_host_cache_gib=GIB_FOR_SLOTS, prefix_cache_ttl_s=0.05
    )
    tiered = Engine(config, loaded_model=model.loaded)
    (prompt, other, _), (follow_up, _, _) = conversations(model.loaded.config.vocab_size, seed=7)
    run(tiered, [prompt], max_new_tokens=4)
    tree = tiered.core.prefix_tree
    held = tree.num_blocks
    time.sleep(1.1)  # past the TTL, and past the period the engine evicts idle entries at
    run(tiered, [other], max_new_tokens=4)  # its steps evict the idle session: into the store
    assert tree.num_stored_blocks >= held and tree.num_evicted_blocks == 0
    ((tokens, num_cached),) = run(tiered, [follow_up], max_new_tokens=6)
    assert num_cached >= 24 and tree.num_restored_total > 0
    assert tokens == run(plain, [follow_up], max_new_tokens=6)[0][0]
    assert_no_leak(tiered)
    for engine in (plain, tiered):
        engine.shutdown()


def test_a_hit_on_host_blocks_waits_for_device_blocks_rather_than_recomputing(tiny_models):
    """A follow-up whose conversation is in host memory arrives while another request holds the
    pool: it waits until blocks are free to restore into and reuses its whole conversation, rather
    than starting at once and recomputing what host memory holds (which takes as many blocks)."""
    model = tiny_models["llama-tiny"]
    plain = Engine(EngineConfig(**SMALL_POOL), loaded_model=model.loaded)
    tiered = Engine(
        EngineConfig(**SMALL_POOL, use_prefix_caching=True, kv_host_cache_gib=GIB_FOR_SLOTS),
        loaded_model=model.loaded,
    )
    (prompt, other, _), (follow_up, _, _) = conversations(model.loaded.config.vocab_size, seed=8)
    run(tiered, [prompt], max_new_tokens=4)
    run(tiered, [other + other[:12]], max_new_tokens=4)  # 36 + 3 tokens: the prompt goes to host
    tree = tiered.core.prefix_tree
    assert tree.num_stored_blocks >= 5
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    busy = tiered.add_request([token + 1 for token in other + other[:12]], params)
    while num_computed(tiered, busy) < 36:
        tiered.step()
    # The busy request holds 9 of the 12 blocks and grows to 11: too few for the stored ones.
    waiting = tiered.add_request(follow_up, params)
    tokens, cached, steps_waited = [], None, 0
    while tiered.has_work():
        steps_waited += num_computed(tiered, waiting) == 0
        for output in tiered.step():
            assert output.error is None, output.error
            if output.request_id == waiting and output.token_id is not None:
                tokens.append(output.token_id)
                cached = output.cached_tokens if cached is None else cached
    assert steps_waited > 1 and cached >= 24, (steps_waited, cached)
    assert tokens == run(plain, [follow_up], max_new_tokens=8)[0][0]
    assert_no_leak(tiered)
    for engine in (plain, tiered):
        engine.shutdown()


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_preempted_requests_resume_from_host_memory_with_the_uncached_tokens(tiny_models, name):
    """Four requests decoding at once in a pool too small for them: a preempted request leaves
    its tokens to the tree, which the others' growth pushes into host memory; it resumes from
    there. The tokens are the uncached engine's."""
    model = tiny_models[name]
    small = {**SETTINGS, "num_gpu_blocks": 14}
    plain = Engine(EngineConfig(**small), loaded_model=model.loaded)
    tiered = Engine(
        EngineConfig(**small, use_prefix_caching=True, kv_host_cache_gib=GIB_FOR_SLOTS),
        loaded_model=model.loaded,
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(model.loaded.config.vocab_size) for _ in range(10)] for _ in range(4)]
    tokens = [tokens for tokens, _ in run(tiered, prompts, max_new_tokens=16)]
    tree = tiered.core.prefix_tree
    assert tiered.stats().num_preempted > 0 and tree.num_restored_total > 0
    assert tokens == [tokens for tokens, _ in run(plain, prompts, max_new_tokens=16)]
    assert_no_leak(tiered)
    for engine in (plain, tiered):
        engine.shutdown()


def test_with_kv_bits_the_host_tier_keeps_blocks_in_int8(tiny_models):
    model = tiny_models["qwen3-tiny"]
    config = EngineConfig(
        **SMALL_POOL, use_prefix_caching=True, kv_host_cache_gib=GIB_FOR_SLOTS, prefix_cache_kv_bits=8,
        prefix_cache_quantize_min_tokens=16,
    )  # fmt: skip
    tiered = Engine(config, loaded_model=model.loaded)
    store = tiered.core.kv_pool.store
    # The device pool keeps all its blocks: the int8 slots are the host's.
    assert isinstance(store, QuantizedKVStore) and store.on_host and tiered.core.kv_pool.num_blocks == 12
    assert store.layers[0][0].device.type == "cpu"
    prompts, follow_ups = conversations(model.loaded.config.vocab_size, seed=6)
    for prompt in prompts:
        run(tiered, [prompt], max_new_tokens=4)
    for prompt in follow_ups:
        ((_, num_cached),) = run(tiered, [prompt], max_new_tokens=6)
        assert num_cached >= 24
    stats = tiered.core.stats()
    assert stats.prefix_cache_store == "host int8"
    assert stats.prefix_cache_restored_total > 0 and stats.kv_host_restored_bytes_total > 0
    assert_no_leak(tiered)
    tiered.shutdown()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_host_cache_gib": 0}, "kv_host_cache_gib must be a number > 0"),
        ({"kv_host_cache_gib": True}, "kv_host_cache_gib must be a number > 0"),
        ({"kv_host_cache_gib": 1, "use_prefix_caching": False}, "set use_prefix_caching=True"),
    ],
)
def test_host_tier_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**settings)
