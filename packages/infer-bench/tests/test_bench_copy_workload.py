"""`infer bench generate --workload copy` on the real SmolLM2: the prompt is the passage of about
300 tokens inside the model's chat template, and the model starts copying it."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from infer.bench.cli import main
from infer.bench.copy_workload import PASSAGE, copy_request_text

SMOLLM2 = Path.home() / ".cache/infer/models/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(SMOLLM2)


def test_passage_is_about_300_tokens(smollm2_tokenizer):
    num_tokens = len(smollm2_tokenizer.encode(PASSAGE, add_special_tokens=False))
    assert 240 <= num_tokens <= 360, num_tokens


@pytest.mark.slow
def test_copy_workload_renders_the_chat_and_the_model_copies(smollm2_tokenizer, tmp_path, capsys):
    json_path = tmp_path / "copy.json"
    argv = ["bench", "generate", "--workload", "copy", "--model", str(SMOLLM2), "--device", "cpu"]
    assert main([*argv, "--gen-tokens", "12", "--json", str(json_path)]) == 0
    report = json.loads(json_path.read_text())
    # transformers renders the same turn with the checkpoint's own template to as many tokens.
    rendered = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": copy_request_text()}], add_generation_prompt=True, tokenize=False
    )
    expected_prompt = smollm2_tokenizer.encode(rendered, add_special_tokens=False)
    assert report["infer"]["num_prompt_tokens"] == len(expected_prompt)
    assert report["infer"]["num_generated"] == 12 and report["infer"]["decode_tokens_per_s"] > 0
    # Greedy SmolLM2 answers with the passage's first words (it stops at EOS only much later).
    output = report["copy"]["output_text"]
    assert len(output.split()) >= 5 and PASSAGE.startswith(output.strip()), output
    assert capsys.readouterr().out.startswith("copy on cpu")
