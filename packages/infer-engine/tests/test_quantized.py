"""8-bit weights through the engine: checkpoints stored fp8 or int8, and int8 quantized at load.

Oracles: the recompute oracle over the same 8-bit model (no cache, the whole sequence every
token) for the engine's cache path, and for the real default model, its fp32 self: int8 per
channel must keep the next-token choices of the text it reads.
"""

import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, SamplingParams, generate
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

from .conftest import TINY_PRESETS, ModelUnderTest

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPT = [5, 91, 200, 17, 300, 42, 7]


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_a_quantized_checkpoint_decodes_as_its_recompute_oracle(preset, method, tmp_path):
    folder = make_random_checkpoint(preset, tmp_path / preset, dtype=torch.float32, quantization=method)
    model = ModelUnderTest(folder)
    assert model.loaded.model.quantization.method == method
    result = model.generate(PROMPT, GREEDY)
    assert len(result.token_ids) == GREEDY.max_new_tokens
    assert result.token_ids == model.oracle.generate(PROMPT, GREEDY).token_ids


def test_the_engine_quantizes_a_dense_checkpoint_at_load_when_configured(tiny_checkpoints):
    folder = tiny_checkpoints["qwen3-tiny"]
    engine = Engine(EngineConfig(model=str(folder), device="cpu", max_seq_len=256, quantization="int8"))
    model = engine.core.loaded.model
    assert model.quantization.method == "int8" and not model.quantization.in_checkpoint
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    assert model.lm_head.weight.dtype == torch.int8
    result = generate(engine, PROMPT, GREEDY)
    assert result.token_ids == RecomputeOracle(engine.core.loaded).generate(PROMPT, GREEDY).token_ids


# The opening of a news-like English paragraph: SmolLM2 predicts most of its next tokens.
TEXT = (
    "The city council met on Tuesday evening to discuss the new budget for the coming year. "
    "Several residents spoke about the need for better roads and more public parks, while the "
    "mayor said that the city must also save money for schools. After a long debate, the council "
    "voted to approve the plan, and the new budget will take effect in January."
)


@torch.inference_mode()
def test_int8_at_load_keeps_the_default_models_next_token_choices(smollm2):
    """Per-channel int8 of every Linear (the LM head too) changes SmolLM2's greedy choice on few
    tokens of natural text, read teacher-forced; a wrong scale or layout changes most."""
    int8 = load_model("smollm2-135m-instruct", dtype=torch.float32, quantization="int8")
    assert int8.model.lm_head.weight.dtype == torch.int8
    ids = smollm2.loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    batch = ForwardBatch.from_tokens([ids])
    dense_choice = smollm2.loaded.model.compute_logits(smollm2.loaded.model(batch)).argmax(-1)
    int8_choice = int8.model.compute_logits(int8.model(batch)).argmax(-1)
    agreement = (dense_choice == int8_choice).float().mean().item()
    print(f"int8 agrees with fp32 on {agreement:.1%} of {len(ids)} next-token choices")
    assert agreement >= 0.9, f"int8 agrees with fp32 on {agreement:.0%} of next-token choices"
