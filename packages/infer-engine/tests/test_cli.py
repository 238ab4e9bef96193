"""`infer generate` on a tiny random checkpoint."""

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


def test_bad_sampling_flag_names_the_rule(tiny_checkpoints, capsys):
    assert (
        main(["generate", "--model", str(tiny_checkpoints["llama-tiny"]), "--temperature", "-3", "hi"]) == 2
    )
    assert "temperature must be >= 0, got -3" in capsys.readouterr().err
