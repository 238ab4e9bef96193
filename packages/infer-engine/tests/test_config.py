"""EngineConfig: every rule is enforced at construction, from code, files and flags alike."""

import argparse
import dataclasses
import json

import pytest

from infer.engine.config import EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args


def test_defaults_are_valid_and_continuous():
    config = EngineConfig()
    assert config.batching_mode == "continuous"
    assert config.kv_cache_backend == "paged" and config.block_size == 16
    # None: the device's measured best, decided when the engine is built (test_device_defaults.py).
    assert (config.use_chunked_prefill, config.use_cuda_graphs, config.max_batch_size) == (None, None, None)


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        (
            {"batching_mode": "static", "use_chunked_prefill": True},
            "use_chunked_prefill=True requires batching_mode='continuous'",
        ),
        (
            {"kv_cache_backend": "contiguous", "use_cuda_graphs": True},
            "use_cuda_graphs=True requires batching_mode='continuous' and kv_cache_backend='paged'",
        ),
        ({"kv_cache_backend": "slotted"}, "kv_cache_backend must be one of"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be >= 1"),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size must be >= 1"),
        ({"max_prefill_chunks_per_step": 0}, "max_prefill_chunks_per_step must be >= 1"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction must be in (0, 1]"),
        (
            {"kv_cache_memory_fraction": 0.5, "num_gpu_blocks": 8},
            "set num_gpu_blocks or kv_cache_memory_fraction",
        ),
        ({"batching_mode": "dynamic"}, "batching_mode must be one of"),
        ({"scheduler_policy": "lifo"}, "scheduler_policy must be one of"),
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
        ({"max_batch_size": True}, "max_batch_size must be an integer"),
        ({"max_batch_size": 16, "max_num_batched_tokens": 8}, "must be >= max_batch_size"),
        ({"decode_service_interval": 0}, "decode_service_interval must be >= 1"),
        ({"max_queue_len": 0}, "max_queue_len must be >= 1"),
        ({"max_seq_len": 1}, "max_seq_len must be >= 2"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be auto, cpu, cuda or cuda:N"),
        ({"model": ""}, "model must be a non-empty string"),
        ({"quantization": "int3"}, "quantization must be one of"),
        (
            {"quantization": "gguf", "device": "cuda:0"},
            "quantization 'gguf' runs a GGUF file's blocks on the CPU only",
        ),
        ({"device_memory_limit_gib": 0}, "device_memory_limit_gib must be a number > 0"),
    ],
)
def test_invalid_settings_name_the_rule(changes, rule):
    with pytest.raises(EngineConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**changes)


@pytest.mark.parametrize("batching_mode", ["static", "continuous"])
@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_either_batching_mode_takes_either_pool(batching_mode, backend):
    config = EngineConfig(batching_mode=batching_mode, kv_cache_backend=backend)
    assert (config.batching_mode, config.kv_cache_backend) == (batching_mode, backend)


def test_config_is_frozen_and_replace_revalidates():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 2
    assert config.replace(max_batch_size=2).max_batch_size == 2
    with pytest.raises(EngineConfigError, match="requires batching_mode='continuous'"):
        config.replace(batching_mode="static", use_chunked_prefill=True)


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(EngineConfigError, match=r"unknown keys \['max_batch', 'temperature'\]"):
        EngineConfig.from_dict({"max_batch": 4, "temperature": 0.5, "seed": 1})


def test_json_and_toml_files_give_the_same_config(tmp_path):
    values = {"max_batch_size": 4, "batching_mode": "static", "kv_cache_backend": "contiguous", "seed": 7}
    (tmp_path / "engine.json").write_text(json.dumps(values))
    (tmp_path / "engine.toml").write_text(
        'max_batch_size = 4\nbatching_mode = "static"\nkv_cache_backend = "contiguous"\nseed = 7\n'
    )
    from_json = EngineConfig.from_file(tmp_path / "engine.json")
    assert from_json == EngineConfig.from_file(tmp_path / "engine.toml") == EngineConfig(**values)


def test_file_with_an_unknown_key_names_the_key_and_the_file(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text("max_batch_size = 4\nmax_batch_sise = 8\n")
    with pytest.raises(EngineConfigError, match=r"unknown keys \['max_batch_sise'\] in .*engine.toml"):
        EngineConfig.from_file(path)


def test_file_suffix_must_be_json_or_toml(tmp_path):
    with pytest.raises(EngineConfigError, match="must end in .json or .toml"):
        EngineConfig.from_file(tmp_path / "engine.yaml")


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return from_cli_args(parser.parse_args(argv))


def test_cli_without_flags_gives_the_defaults():
    assert _parse([]) == EngineConfig()


def test_cli_flags_override_the_config_file(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"max_batch_size": 4, "scheduler_policy": "prefill_first"}))
    config = _parse(["--engine-config", str(path), "--max-batch-size", "2", "--max-seq-len", "512"])
    assert (config.max_batch_size, config.scheduler_policy, config.max_seq_len) == (2, "prefill_first", 512)


def test_cli_rejects_a_combination_the_config_rejects():
    with pytest.raises(EngineConfigError, match="requires batching_mode='continuous'"):
        _parse(["--batching-mode", "static", "--use-chunked-prefill", "true"])


def test_cli_parses_float_and_optional_int_flags():
    config = _parse(["--kv-cache-memory-fraction", "0.8", "--max-prefill-chunks-per-step", "2"])
    assert (config.kv_cache_memory_fraction, config.max_prefill_chunks_per_step) == (0.8, 2)


def test_cli_parses_the_quantization_and_the_memory_limit():
    config = _parse(["--quantization", "int8", "--device-memory-limit-gib", "16"])
    assert (config.quantization, config.device_memory_limit_gib) == ("int8", 16.0)
    assert _parse([]).quantization is None
    assert _parse(["--quantization", "int4"]).quantization == "int4"


def test_native_cpu_kernels_are_on_unless_turned_off():
    assert _parse([]).use_native_cpu_kernels is True
    assert _parse(["--use-native-cpu-kernels", "false"]).use_native_cpu_kernels is False
    with pytest.raises(EngineConfigError, match="use_native_cpu_kernels must be true or false"):
        EngineConfig(use_native_cpu_kernels="avx2")


def test_cli_choices_come_from_the_config():
    with pytest.raises(SystemExit):
        _parse(["--scheduler-policy", "lifo"])
