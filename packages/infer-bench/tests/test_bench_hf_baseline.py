"""The transformers continuous-batching baseline on a tiny random checkpoint (CPU): it must produce
exactly what transformers' own greedy `generate` produces for each prompt, at full length."""

import json

import pytest
import torch

from infer.bench.serving.cli import main as bench_main
from infer.bench.serving.hf_baseline import run_hf_baseline
from infer.bench.serving.workloads import WorkloadShape, make_workload
from infer.models.random_checkpoint import PRESETS, make_random_checkpoint

TINY = WorkloadShape("completion", prompt_tokens=(4, 12), output_tokens=(2, 5))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_random_checkpoint("llama-tiny", tmp_path_factory.mktemp("llama-tiny"), dtype=torch.float32)


def test_continuous_batching_matches_greedy_generate_at_full_length(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, GenerationConfig

    vocab_size = PRESETS["llama-tiny"].config["vocab_size"]
    workload = make_workload("tiny", shape=TINY, concurrency=2, num_requests=4, vocab_size=vocab_size)
    report = run_hf_baseline(str(tiny_checkpoint), workload, device="cpu", dtype="float32")
    assert report["stats"]["num_errors"] == 0
    assert report["stats"]["output_tokens"] == sum(r.max_tokens for r in workload.requests)  # EOS ignored
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    for request, generated in zip(workload.requests, report["generated_tokens"], strict=True):
        ids = torch.tensor([request.prompt_token_ids])
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=request.max_tokens,
            min_new_tokens=request.max_tokens,
            pad_token_id=0,
        )
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert generated == expected[0, ids.shape[1] :].tolist()
    assert report["stats"]["ttft_s"]["count"] == workload.num_requests


def test_cli_refuses_ids_outside_the_vocabulary(tiny_checkpoint, capsys):
    status = bench_main(
        ["hf-baseline", "--model", str(tiny_checkpoint), "--workload", "W1", "--device", "cpu"]
    )
    assert status == 1
    assert "--vocab-size 384" in capsys.readouterr().err


def test_cli_writes_the_report(tiny_checkpoint, tmp_path):
    json_path = tmp_path / "hf.json"
    status = bench_main([
        "hf-baseline", "--model", str(tiny_checkpoint), "--workload", "W2", "--concurrency", "1",
        "--num-requests", "1", "--vocab-size", "384", "--device", "cpu", "--dtype", "float32",
        "--json", str(json_path),
    ])  # fmt: skip
    assert status == 0
    report = json.loads(json_path.read_text())
    assert report["environment"]["attn_implementation_used"] in ("sdpa", "paged|sdpa", "paged|eager")
    assert report["stats"]["output_tokens"] == report["workload"]["total_max_tokens"]


def test_cli_refuses_a_workload_with_images(tmp_path, capsys):
    """transformers' text continuous batching would get W6's image parts as text."""
    status = bench_main(["hf-baseline", "--model", str(tmp_path), "--workload", "W6"])
    assert status == 1
    assert "W6's images would not reach the model" in capsys.readouterr().err
