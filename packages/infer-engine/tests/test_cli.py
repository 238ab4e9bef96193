"""`infer generate` on a tiny random checkpoint."""

import json
import shutil

from infer.engine import SamplingParams
from infer.engine.cli import main


def test_generate_streams_the_generators_text(tiny_checkpoints, tiny_models, capsys):
    folder = tiny_checkpoints["llama-tiny"]
    assert (
        main(["generate", "--model", str(folder), "--max-tokens", "12", "--ignore-eos", "hello", "world"])
        == 0
    )
    out, err = capsys.readouterr()
    model = tiny_models["llama-tiny"]
    prompt_ids = model.loaded.tokenizer.encode("hello world", add_special_tokens=True)
    expected = model.oracle.generate(
        prompt_ids, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    )
    assert out == expected.text + "\n"
    assert "12 tokens, finish length" in err and "tokens/s" in err


def test_serve_style_argv_with_flags_before_the_prompt(tiny_checkpoints, capsys):
    folder = tiny_checkpoints["gemma3-tiny"]
    argv = [
        "generate",
        "--chat",
        "--model",
        str(folder),
        "--max-tokens",
        "4",
        "What is the capital of France?",
    ]
    assert main(argv) == 0
    assert "tokens, finish" in capsys.readouterr().err


def test_chat_on_a_model_without_its_own_template_warns(tiny_checkpoints, tmp_path, capsys):
    base = tiny_checkpoints["llama-tiny"]  # random checkpoints ship no chat template
    argv = ["generate", "--chat", "--max-tokens", "2", "hi"]
    assert main([*argv, "--model", str(base)]) == 0
    assert "ships no chat template (a base model?)" in capsys.readouterr().err
    instruct = tmp_path / "instruct"
    shutil.copytree(base, instruct)
    config_path = instruct / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config_path.write_text(json.dumps(config))
    assert main([*argv, "--model", str(instruct)]) == 0
    assert "chat template" not in capsys.readouterr().err


def test_bad_sampling_flag_names_the_rule(tiny_checkpoints, capsys):
    assert (
        main(["generate", "--model", str(tiny_checkpoints["llama-tiny"]), "--temperature", "-3", "hi"]) == 2
    )
    assert "temperature must be >= 0, got -3" in capsys.readouterr().err
