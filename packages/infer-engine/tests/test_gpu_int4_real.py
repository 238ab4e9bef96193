"""On CUDA in bf16, models with real weights quantized to int4 at load (round to nearest, groups
of 128 columns; 64 where a Linear's inputs are not a multiple of 128, SmolLM2's 576), against the
same 4-bit weights dequantized into a dense bf16 model of ours (`dequantized_copy`):

- the logits of one forward over a paragraph of English, within LOGIT_BOUND_UNITS bf16 units at
  the logits' magnitude;
- 64 greedy tokens through the engine with the device's defaults (CUDA graphs, async scheduling,
  chunked prefill; on Hopper PDL and the Triton GEMV), the prompts together (batched steps) and
  one at a time (one-row steps), against the dense twin's greedy tokens (the recompute oracle):
  the leading tokens that agree are printed, and the sequences must be equal up to a near tie.

The two sides differ by more than summation order: the twin's weights are each 4-bit value times
its scale rounded to bf16, where the one-row and tensor-core kernels scale fp32 sums of exact
`q - zero` products and round nothing. So a near tie here is a gap of at most LOGIT_BOUND_UNITS
between the twin's logits of the two chosen tokens, the error the first oracle allows, rather
than test_gpu.py's two units.

SmolLM2-135M-Instruct's weights are the Q4_1 GGUF it ships as (the default model; converted to
bf16 by `infer models fetch`); every projection of Gemma 3 270M has inputs a multiple of 128.
"""

import dataclasses

import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.models.forward_batch import ForwardBatch
from infer.models.load import LoadedModel, load_model

from .test_gpu import bf16_ulp, run_together
from .test_gpu_quantized import dequantized_copy
from .test_quantized import TEXT

MODELS = ["smollm2-135m-instruct", "gemma-3-270m"]
NUM_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important things to remember when learning to cook are",
]
# bf16 units at the logits' magnitude, as test_gpu_quantized's 8-bit bound. On a 2-core CPU
# (int4_linear's PyTorch reference, fp32 products): 3.2 units at logits near 33 (SmolLM2), 3.5
# near 30 (Gemma 3 270M).
LOGIT_BOUND_UNITS = 8


@dataclasses.dataclass
class Int4Pair:
    """A real model quantized to int4 at load, and its dense twin: the same but for `model`."""

    alias: str
    int4: LoadedModel
    dense: LoadedModel


def load_int4_pair(alias: str, device: str) -> Int4Pair:
    int4 = load_model(alias, dtype=torch.bfloat16, device=device, quantization="int4")
    assert int4.model.quantization.method == "int4"
    # Every projection 4-bit, the embedding and LM head kept in bf16.
    for layer in int4.model.layers:
        for module in layer.modules():
            if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2:
                assert module.weight.dtype == torch.uint8, (alias, module)
    dense = dataclasses.replace(int4, model=dequantized_copy(int4.model))
    return Int4Pair(alias, int4, dense)


@pytest.fixture(scope="module", params=MODELS)
def int4_pair(request) -> Int4Pair:
    return load_int4_pair(request.param, "cuda")


def encode(loaded, text: str) -> list[int]:
    # With the tokenizer's own special tokens: Gemma's <bos>, without which its text is noise.
    return loaded.tokenizer.encode(text, add_special_tokens=True)


@torch.inference_mode()
def largest_logit_error(pair: Int4Pair, device: str) -> tuple[float, float]:
    """(largest |int4 - dense| logit over the paragraph, in bf16 units at the logits' magnitude;
    that magnitude)."""
    batch = ForwardBatch.from_tokens([encode(pair.int4, TEXT)], device=device)
    ours = pair.int4.model.compute_logits(pair.int4.model(batch)).float()
    expected = pair.dense.model.compute_logits(pair.dense.model(batch)).float()
    scale = expected.abs().max().item()
    return (ours - expected).abs().max().item() / bf16_ulp(scale), scale


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)


def dense_greedy(pair: Int4Pair, prompts: list[list[int]]) -> list[list[int]]:
    oracle = RecomputeOracle(pair.dense)
    return [oracle.generate(prompt, greedy_params()).token_ids for prompt in prompts]


def int4_greedy(pair: Int4Pair, prompts: list[list[int]], config: EngineConfig) -> dict[str, list[list[int]]]:
    """The engine's tokens for the prompts together, and each one alone."""
    engine = Engine(config, loaded_model=pair.int4)
    together = run_together(engine, prompts, greedy_params())
    alone = [run_together(engine, [prompt], greedy_params())[0] for prompt in prompts]
    engine.shutdown()
    return {"together": together, "alone": alone}


@torch.inference_mode()
def first_difference_gap_units(dense_model, prompt, ours, theirs, device: str) -> tuple[int, float]:
    """(leading tokens that agree; at the first that differs, how far the dense model's logit of
    the int4 model's token lies below its own choice's, in bf16 units; 0.0 where all agree)."""
    assert len(ours) == len(theirs) == NUM_TOKENS
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if first is None:
        return NUM_TOKENS, 0.0
    sequence = prompt + theirs[:first]
    hidden = dense_model(ForwardBatch.from_tokens([sequence], device=device))
    logits = dense_model.compute_logits(hidden[-1:])[0].float()
    chosen, ours_logit = logits[theirs[first]].item(), logits[ours[first]].item()
    return first, (chosen - ours_logit) / bf16_ulp(max(abs(chosen), abs(ours_logit)))


@pytest.mark.gpu
def test_int4_logits_of_a_real_model_are_those_of_its_dequantized_weights(int4_pair):
    error_units, scale = largest_logit_error(int4_pair, "cuda")
    print(f"{int4_pair.alias}: largest logit error {error_units:.1f} bf16 units at {scale:.1f}")
    assert error_units <= LOGIT_BOUND_UNITS, int4_pair.alias


@pytest.mark.gpu
def test_int4_greedy_tokens_of_a_real_model_are_its_dequantized_models_up_to_a_near_tie(int4_pair):
    prompts = [encode(int4_pair.int4, text) for text in PROMPTS]
    expected = dense_greedy(int4_pair, prompts)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=1024)
    for mode, tokens in int4_greedy(int4_pair, prompts, config).items():
        for prompt, ours, theirs in zip(prompts, tokens, expected, strict=True):
            agree, gap = first_difference_gap_units(int4_pair.dense.model, prompt, ours, theirs, "cuda")
            print(
                f"{int4_pair.alias} {mode}, prompt of {len(prompt)}: {agree} of {NUM_TOKENS} "
                f"leading tokens agree (dense gap at the first difference {gap:.1f} bf16 units)"
            )
            assert gap <= LOGIT_BOUND_UNITS, (
                f"{int4_pair.alias} {mode}: step {agree} chose {ours[agree]}, the dense model "
                f"{theirs[agree]}, whose logits differ by {gap:.1f} bf16 units, more than "
                f"{LOGIT_BOUND_UNITS}"
            )
