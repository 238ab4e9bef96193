"""8-bit and 4-bit weights through the engine: checkpoints stored fp8, int8, GPTQ or AWQ, and
int8 and int4 quantized at load.

Oracles: the recompute oracle over the same 8-bit model (no cache, the whole sequence every
token) for the engine's cache path, and for the real default model, its fp32 self: int8 per
channel must keep the next-token choices of the text it reads, int4 most of its fit to it. A
4-bit model's greedy tokens are those of its weights dequantized and run dense.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, SamplingParams, generate
from infer.kernels import dequantize_int4
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint
from infer.models.weight_map import FUSED_PROJECTIONS

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


# --- 4-bit weights -------------------------------------------------------------------------------

# GPTQ (symmetric, v1), GPTQ with act-order, AWQ: each a random checkpoint's quantization_config.
INT4_CHECKPOINTS = {
    "gptq": ("gptq", None),
    "gptq-act-order": ("gptq", {"desc_act": True}),
    "awq": ("awq", None),
}


def dequantized_copy(model, folder, out):
    """A dense fp32 checkpoint of `model`'s 4-bit weights (the layout's reference,
    infer.kernels.dequantize_int4, act-order undone), split into the checkpoint's q, k, v, gate
    and up, beside the rest of `folder`. infer-models' tests check these weights against GPTQModel's
    and AutoAWQ's own dequantization."""
    out.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    tensors = {
        name: tensor
        for name, tensor in load_file(folder / "model.safetensors").items()
        if not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx", "_proj.weight"))
    }
    for name, linear in model.named_modules():
        if getattr(linear, "group_size", None) is None:
            continue
        dense = dequantize_int4(linear.weight, linear.weight_scale, linear.weight_zero, linear.group_size)
        if linear.input_perm is not None:
            dense = torch.empty_like(dense).index_copy_(1, linear.input_perm, dense)
        parent, _, leaf = name.rpartition(".")
        parts = FUSED_PROJECTIONS.get(leaf, (leaf,))
        for part, rows in zip(parts, dense.split(list(linear.output_sizes)), strict=True):
            tensors[f"model.{parent}.{part}.weight"] = rows.contiguous()
    save_file(tensors, out / "model.safetensors")
    return out


def greedy_tokens(folder, **config) -> list[int]:
    engine = Engine(EngineConfig(model=str(folder), device="cpu", max_seq_len=256, **config))
    return generate(engine, PROMPT, GREEDY).token_ids


@pytest.mark.parametrize("checkpoint", [*INT4_CHECKPOINTS, "int4-at-load"])
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_4bit_weights_decode_the_tokens_of_their_dequantized_dense_model(preset, checkpoint, tmp_path):
    """Through the engine (its cache, decode steps), a 4-bit model's greedy tokens are those of
    the same weights dequantized and run dense."""
    if checkpoint == "int4-at-load":
        folder, config = (
            make_random_checkpoint(preset, tmp_path / "q", dtype=torch.float32),
            {"quantization": "int4"},
        )
    else:
        method, overrides = INT4_CHECKPOINTS[checkpoint]
        folder = make_random_checkpoint(
            preset, tmp_path / "q", dtype=torch.float32, quantization=method, quantization_config=overrides
        )
        config = {}
    model = load_model(folder, dtype=torch.float32, quantization=config.get("quantization")).model
    assert model.quantization.is_int4 and model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    dense = dequantized_copy(model, folder, tmp_path / "dense")
    tokens = greedy_tokens(folder, **config)
    assert len(tokens) == GREEDY.max_new_tokens
    assert tokens == greedy_tokens(dense)


@torch.inference_mode()
def test_int4_at_load_keeps_the_default_models_loss_on_text(smollm2):
    """Round-to-nearest 4-bit weights cost a small model some of its fit to natural text: on
    this paragraph SmolLM2's loss went from 2.73 to 2.97 nats a token (2-core CPU VM, 7394ada); a wrong
    layout or zero point gives a loss far above (any weight a step off its group's grid)."""
    int4 = load_model("smollm2-135m-instruct", dtype=torch.float32, quantization="int4")
    assert int4.model.layers[0].mlp.down_proj.group_size == 128
    ids = smollm2.loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    batch = ForwardBatch.from_tokens([ids])
    targets = torch.tensor(ids[1:])[:, None]

    def loss(model) -> float:
        logprobs = model.compute_logits(model(batch)).log_softmax(-1)[:-1]
        return -logprobs.gather(1, targets).mean().item()

    dense_loss, int4_loss = loss(smollm2.loaded.model), loss(int4.model)
    print(f"loss on the paragraph: {dense_loss:.2f} nats a token dense, {int4_loss:.2f} int4")
    assert int4_loss <= dense_loss + 0.5, (dense_loss, int4_loss)
