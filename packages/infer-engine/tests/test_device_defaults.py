"""The engine's defaults are the measured best for the device; every switch stays an escape hatch.

The oracle is the rule the project set for them (vLLM's conventions on CUDA: fast paths on, 0.9
of free memory to the KV pool, 256 sequences), applied to configs as a user writes them.
"""

import argparse

import pytest

from infer.engine.config import AUTO_FLAGS, EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args
from infer.engine.device_defaults import resolve

HOPPER, AMPERE = (9, 0), (8, 0)


def test_on_hopper_every_fast_path_is_on_and_the_pool_takes_free_memory():
    resolved = resolve(EngineConfig(), cuda_capability=HOPPER)
    config = resolved.config
    assert all(getattr(config, name) is True for name in AUTO_FLAGS)
    assert config.kv_cache_memory_fraction == 0.9 and config.num_gpu_blocks is None
    assert config.max_batch_size == 256
    assert resolved.off_reasons == {}
    line = resolved.describe()
    assert "CUDA graphs" in line and "Triton GEMV" in line and "off:" not in line


def test_before_hopper_pdl_and_the_gemv_stay_off_and_the_line_says_why():
    resolved = resolve(EngineConfig(), cuda_capability=AMPERE)
    assert (resolved.config.use_pdl, resolved.config.use_triton_gemv) == (False, False)
    assert resolved.config.use_cuda_graphs and resolved.config.use_prefix_caching
    assert resolved.off_reasons["use_pdl"] == "not measured on compute capability 8.0"
    assert "off: PDL (not measured on compute capability 8.0)" in resolved.describe()


def test_on_a_cpu_the_defaults_are_unchanged():
    config = resolve(EngineConfig(), cuda_capability=None).config
    assert not any(getattr(config, name) for name in AUTO_FLAGS)
    assert config.max_batch_size == 8
    assert config.kv_cache_memory_fraction is None  # the pool holds max_batch_size whole sequences


def test_an_explicit_false_is_kept_and_named():
    resolved = resolve(EngineConfig(use_cuda_graphs=False, use_pdl=False), cuda_capability=HOPPER)
    assert (resolved.config.use_cuda_graphs, resolved.config.use_pdl) == (False, False)
    assert resolved.config.async_scheduling is True
    assert resolved.off_reasons == {
        "use_cuda_graphs": "--use-cuda-graphs false",
        "use_pdl": "--use-pdl false",
    }


def test_explicit_sizes_are_kept():
    config = resolve(EngineConfig(max_batch_size=16, num_gpu_blocks=100), cuda_capability=HOPPER).config
    assert (config.max_batch_size, config.num_gpu_blocks, config.kv_cache_memory_fraction) == (16, 100, None)
    # The step budget must hold a decode of every running request: 256 shrinks to fit it.
    assert (
        resolve(EngineConfig(max_num_batched_tokens=128), cuda_capability=HOPPER).config.max_batch_size == 128
    )


def test_static_batching_turns_off_what_needs_continuous_batching():
    resolved = resolve(EngineConfig(batching_mode="static"), cuda_capability=HOPPER)
    for name in ("use_chunked_prefill", "use_prefix_caching", "use_cuda_graphs"):
        assert getattr(resolved.config, name) is False
        assert resolved.off_reasons[name] == "static batching"


def test_contiguous_kv_turns_off_graphs_and_the_prefix_cache():
    resolved = resolve(EngineConfig(kv_cache_backend="contiguous"), cuda_capability=HOPPER)
    assert resolved.off_reasons["use_cuda_graphs"] == "contiguous KV"
    assert resolved.off_reasons["use_prefix_caching"] == "contiguous KV"
    assert resolved.config.use_chunked_prefill is True


def test_chunked_prefill_off_takes_the_prefix_cache_with_it():
    resolved = resolve(EngineConfig(use_chunked_prefill=False), cuda_capability=HOPPER)
    assert resolved.config.use_prefix_caching is False
    assert resolved.off_reasons["use_prefix_caching"] == "chunked prefill is off"


def test_asking_for_the_prefix_cache_on_a_cpu_brings_chunked_prefill():
    for config in (EngineConfig(use_prefix_caching=True), EngineConfig(prefix_cache_shadow_rate=0.5)):
        resolved = resolve(config, cuda_capability=None).config
        assert (resolved.use_prefix_caching, resolved.use_chunked_prefill) == (True, True)


def test_a_cuda_only_switch_asked_for_on_a_cpu_config_is_refused():
    with pytest.raises(EngineConfigError, match="use_cuda_graphs=True needs a CUDA device"):
        EngineConfig(device="cpu", use_cuda_graphs=True)


def test_a_flag_set_to_false_turns_a_default_off():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert from_cli_args(parser.parse_args([])).use_cuda_graphs is None
    assert from_cli_args(parser.parse_args(["--use-cuda-graphs", "false"])).use_cuda_graphs is False
    assert from_cli_args(parser.parse_args(["--use-cuda-graphs"])).use_cuda_graphs is True


def test_speculation_keeps_async_scheduling_and_the_line_names_it_and_its_back_off():
    """The engine overlaps every step but those before a step that may verify drafts
    (EngineCore.step), so async scheduling stays on with speculation."""
    speculative = {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 4}
    resolved = resolve(EngineConfig(speculative_config=speculative), cuda_capability=HOPPER)
    assert resolved.config.async_scheduling is True and resolved.config.use_cuda_graphs is True
    assert "async_scheduling" not in resolved.off_reasons
    line = resolved.describe()
    assert "speculative decoding: draft_model, 4 draft tokens, backing off below 0.3 kept" in line
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    line = resolve(EngineConfig(speculative_config=ngram), cuda_capability=HOPPER).describe()
    assert "speculative decoding: ngram, 3 draft tokens" in line and "backing off" not in line


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, r"speculative_config.method must be one of"),
        ({"method": "ngram"}, r"speculative_config.num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be >= 1, got 0"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "eagle": 1}, r"unknown keys \['eagle'\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model .* is required"),
        ("ngram", r"speculative_config must be a mapping"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 1.5},
            r"speculative_config.min_acceptance_rate must be a number in \[0, 1\), got 1.5",
        ),
    ],
)
def test_a_speculative_config_is_checked_at_construction_naming_its_key(given, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(speculative_config=given)


def test_speculative_config_comes_from_the_command_line_as_json_with_vllms_defaults():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    speculative = from_cli_args(args).speculative
    # vLLM's rule: neither lookup bound given, both are 5.
    assert (
        speculative.num_speculative_tokens,
        speculative.prompt_lookup_min,
        speculative.prompt_lookup_max,
    ) == (
        3,
        5,
        5,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])
