"""EngineConfig: every rule is enforced at construction, from code, files and flags alike."""

import argparse
import dataclasses
import json

import pytest

from infer.engine.config import EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args


def test_defaults_are_valid_and_continuous():
    config = EngineConfig()
    assert config.batching_mode == "continuous"
    assert config.kv_cache_backend == "slotted"


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        (
            {"batching_mode": "continuous", "kv_cache_backend": "contiguous"},
            "requires kv_cache_backend='slotted'",
        ),
        ({"kv_cache_backend": "paged"}, "reserved and not implemented"),
        ({"kv_cache_backend": "ring"}, "kv_cache_backend must be one of"),
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
    ],
)
def test_invalid_settings_name_the_rule(changes, rule):
    with pytest.raises(EngineConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**changes)


@pytest.mark.parametrize("backend", ["contiguous", "slotted"])
def test_static_batching_takes_either_cache(backend):
    assert EngineConfig(batching_mode="static", kv_cache_backend=backend).kv_cache_backend == backend


def test_config_is_frozen_and_replace_revalidates():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 2
    assert config.replace(max_batch_size=2).max_batch_size == 2
    with pytest.raises(EngineConfigError, match="requires kv_cache_backend='slotted'"):
        config.replace(kv_cache_backend="contiguous")


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
    with pytest.raises(EngineConfigError, match="requires kv_cache_backend='slotted'"):
        _parse(["--kv-cache-backend", "contiguous"])


def test_cli_choices_come_from_the_config():
    with pytest.raises(SystemExit):
        _parse(["--scheduler-policy", "lifo"])
