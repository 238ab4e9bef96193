"""`infer bench generate` and `infer profile` on a tiny random checkpoint."""

import json

import pytest
import torch
from safetensors import safe_open

from infer.bench.cli import main


def test_bench_generate_reports_and_matches_transformers(tiny_checkpoints, tmp_path, capsys):
    folder = tiny_checkpoints["qwen3-tiny"]
    json_path = tmp_path / "w1.json"
    argv = ["bench", "generate", "--model", str(folder), "--prompt-tokens", "16", "--gen-tokens", "8"]
    assert main([*argv, "--compare-hf", "--json", str(json_path)]) == 0
    report = json.loads(json_path.read_text())
    assert report["infer"]["num_generated"] == 8 and report["transformers"]["num_generated"] == 8
    assert report["greedy_tokens_match_transformers"]["match"]
    assert report["infer"]["prefill_tokens_per_s"] > 0 and report["infer"]["decode_tokens_per_s"] > 0
    assert report["flags"]["gen_tokens"] == 8 and report["environment"]["torch"] == torch.__version__
    with safe_open(folder / "model.safetensors", "pt") as f:
        checkpoint_bytes = sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118
    assert report["memory"]["weights_bytes"] == checkpoint_bytes
    assert report["memory"]["kv_bytes"] > 0
    # The roofline: the weights (tied or not, the untied input table is not read) and the K/V of
    # each decode step's context, over the copy bandwidth measured in the process.
    config = json.loads((folder / "config.json").read_text())
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    embedding = config["vocab_size"] * config["hidden_size"] * 4
    weights = checkpoint_bytes - (0 if config["tie_word_embeddings"] else embedding)
    mean_context = sum(16 + k for k in range(1, 8)) / 7
    roofline = report["roofline"]
    assert roofline["bytes_per_decode_token"] == pytest.approx(weights + kv_per_token * mean_context)
    assert roofline["decode_tokens_per_s"] == pytest.approx(
        roofline["copy_bandwidth_bytes_per_s"] / roofline["bytes_per_decode_token"]
    )
    assert roofline["infer_percent"] == pytest.approx(
        100 * report["infer"]["decode_tokens_per_s"] / roofline["decode_tokens_per_s"]
    )
    assert 0 < roofline["transformers_percent"] < 100
    out = capsys.readouterr().out
    assert "| infer | paged |" in out and f"infer decodes at {roofline['infer_percent']:.1f}%" in out


def test_profile_writes_a_chrome_trace_and_a_table(tiny_checkpoints, tmp_path, capsys):
    folder = tiny_checkpoints["llama-tiny"]
    assert main(["profile", "--model", str(folder), "--out", str(tmp_path), "--gen-tokens", "4"]) == 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"infer.prefill", "infer.decode_step"} <= names
    assert "Self CPU" in capsys.readouterr().out


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_bench_generate_with_speculation_reports_what_the_replayed_drafts_predict(
    tiny_checkpoints, tmp_path, capsys
):
    """`--speculative-config`: the report's acceptance figures are those of a replay of the timed
    run (conformance.spec_decode_replay: the n-gram proposer over W1's prompt and the greedy tokens
    of the recompute oracle); the warm-up run is not counted."""
    from conformance.oracles import RecomputeOracle
    from conformance.spec_decode_replay import replay_ngram
    from infer.bench.generation import random_prompt
    from infer.engine.sampling_params import SamplingParams
    from infer.models.load import load_model

    folder = tiny_checkpoints["llama-tiny"]
    json_path = tmp_path / "w1-spec.json"
    argv = ["bench", "generate", "--model", str(folder), "--prompt-tokens", "16", "--gen-tokens", "48",
            "--speculative-config", json.dumps(NGRAM), "--json", str(json_path)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(json_path.read_text())
    loaded = load_model(str(folder), dtype=torch.float32, device="cpu")
    prompt = random_prompt(loaded, 16, seed=0)
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    output = RecomputeOracle(loaded).generate(prompt, params).token_ids
    replayed = replay_ngram(NGRAM, prompt, output, 48)
    assert replayed.num_accepted_tokens > 0  # the tiny model repeats itself: drafts were accepted
    assert report["infer"]["spec_decode"] == replayed.bench_figures(NGRAM["num_speculative_tokens"])
    accepted = replayed.num_accepted_tokens
    assert report["infer"]["num_generated"] == 48
    assert f"acceptance {100 * accepted / replayed.num_draft_tokens:.1f}%" in capsys.readouterr().out
