"""The CPU default model run as shipped: SmolLM2-135M's Q4_1 GGUF file with its blocks packed
(`quantization="gguf"`), against infer's own dequantized fp32 model of the same file (every tensor
dequantized at load, `load_gguf_causal_lm(packed=False)`), on the parity prompts
(specs/parity/cases.yaml) and their greedy continuations.

The packed Linears round x to int8 blocks of 32 (gguf_gemv_cpu.c, as llama.cpp does), the dense
model does not. That rounding alone, computed by PyTorch (each packed Linear's method replaced by
`gguf_linear_cpu_q8_ref`), moves the logits by `delta` (about 1.2 on these sequences): the packed
model's logits must lie within 2 * delta of the dense model's, and its greedy token may differ
from the dense model's only where the dense model's top two are within 2 * delta of each other
(a near tie, printed). Wrong nibble order or a dropped Q4_1 offset moves the logits by tens.

The dense model is checked on its own against the folder transformers converted from the same
file (bf16 weights, Llama's q/k permutation undone by transformers): within the bf16 rounding of
the weights.
"""

import copy

import pytest
import torch

from conformance.paged_batches import PagedRow, grow, paged_batch, scrambled_pool
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.kernels import DecoderStackCpu, gguf_linear_cpu_q8_ref
from infer.kernels.cpu.native import load_native
from infer.models import load_model
from infer.models.forward_batch import ForwardBatch
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
from infer.models.linear import Linear
from infer.models.linear_method import DequantizedGgufMethod, GgufMethod
from infer.models.loader.gguf_weights import gguf_file_tensors, load_gguf_causal_lm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
]
NEW_TOKENS = 32


class _RoundedX(GgufMethod):
    """The packed product as the kernel computes it, in PyTorch: x rounded to int8 blocks."""

    def apply(self, layer, x):
        return gguf_linear_cpu_q8_ref(x, layer.weight, layer.gguf_format, layer.bias)


@pytest.fixture(scope="module")
def models():
    packed = load_model("smollm2-135m-instruct", dtype=torch.float32, quantization="gguf")
    config, model_class = packed.config, type(packed.model)
    dense = load_gguf_causal_lm(packed.path, config, model_class, packed=False)
    rounded = load_gguf_causal_lm(packed.path, config, model_class)
    for module in rounded.modules():
        if isinstance(module, Linear):
            module.method = _RoundedX()
    return packed, apply_kernel_policy(dense.eval(), KernelPolicy("cpu")), rounded.eval()


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ForwardBatch.from_tokens([ids])))


def greedy(model, ids: list[int], count: int) -> list[int]:
    """`ids` and the model's `count` greedy tokens after them, through a paged KV cache: the
    sequences the logits are compared on (a cache-free loop ran 32 forwards of the whole
    sequence, 12 s a prompt)."""
    ids = list(ids)
    pool = scrambled_pool(model, 16, len(ids) + count)
    block_ids: list[int] = []
    num_cached, step_ids = 0, list(ids)
    with torch.inference_mode():
        for _ in range(count):
            grow(pool, block_ids, num_cached + len(step_ids), "sequence")
            hidden = model(paged_batch(pool, [PagedRow(block_ids, num_cached, step_ids)]))
            ids.append(int(model.compute_logits(hidden[-1:])[-1].argmax()))
            num_cached, step_ids = num_cached + len(step_ids), ids[-1:]
    return ids


def test_the_loader_reads_a_files_tensors_as_gguf_reader_does(tmp_path):
    """The loader steps over the metadata itself (gguf_file_tensors): every tensor as
    gguf.GGUFReader reads it, from a file of every metadata kind, a custom alignment and dense and
    block tensors. (On the shipped file, test_the_dense_model_matches_transformers_conversion
    checks what the loader read against transformers' own reading of it.)"""
    import gguf
    import numpy as np

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(256)
    writer.add_string("a.string", "héllo")
    writer.add_array("a.strings", ["x", "yz", ""])
    writer.add_array("a.numbers", [1, 2, 3])
    writer.add_array("a.nested", [[1.5, 2.5], ["p", "q"]])
    writer.add_bool("a.bool", True)
    writer.add_float64("a.float64", 0.25)
    writer.add_int64("a.int64", -7)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8_0 = gguf.quants.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8_0", q8_0, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = gguf_file_tensors(path), gguf.GGUFReader(path).tensors
    assert [(t.name, t.tensor_type) for t in ours] == [(t.name, t.tensor_type) for t in theirs]
    for got, expected in zip(ours, theirs, strict=True):
        assert (got.data.dtype, got.data.shape) == (expected.data.dtype, expected.data.shape), got.name
        assert np.array_equal(got.data.view(np.uint8), expected.data.view(np.uint8)), got.name


def test_the_packed_model_keeps_its_blocks(models):
    packed, _, _ = models
    model = packed.model
    # The file's Q8_0 table, repacked at load four rows to a stream (infer.kernels' GGUF_REPACKED).
    assert model.embed_tokens.gguf_format == "q8_0x4" and model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].self_attn.qkv_proj.gguf_format == "q4_1"
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    # Q4_1 reads 20 bytes a block of 32: 0.625 a weight.
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (3072, 576 // 32 * 20)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["france", "fibonacci", "once"])
def test_logits_lie_within_the_rounding_of_x(models, prompt):
    packed, dense, rounded = models
    ids = greedy(dense, packed.tokenizer.encode(prompt, add_special_tokens=False), NEW_TOKENS)
    ours, theirs, reference_rounded = logits(packed.model, ids), logits(dense, ids), logits(rounded, ids)
    delta = (reference_rounded - theirs).abs().max().item()
    error = (ours - theirs).abs().max().item()
    print(f"{prompt[:20]!r}: packed - dense {error:.3f}, the rounding of x alone {delta:.3f}")
    assert 0 < delta < 5, "the rounding of x should move the logits, and by a few tenths to units"
    assert error <= 2 * delta


def test_the_dense_model_matches_transformers_conversion(models):
    packed, dense, _ = models
    converted = load_model(packed.path, dtype=torch.float32).model
    for prompt in PROMPTS:
        ids = packed.tokenizer.encode(prompt, add_special_tokens=False)
        ours, theirs = logits(dense, ids), logits(converted, ids)
        # The folder's weights are ours rounded to bf16 (8 significant bits): measured 0.22.
        assert (ours - theirs).abs().max() < 0.5
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.skipif(not DecoderStackCpu.runs_here(), reason="the C kernels do not build here")
def test_greedy_tokens_through_the_engine_equal_the_dense_models_but_near_ties(models):
    packed, dense, rounded = models
    config = EngineConfig(model=str(packed.path), device="cpu", max_seq_len=256, max_batch_size=1)
    engine = Engine(config, loaded_model=packed)
    assert engine.core.runner.cpu_decode is not None, "the C decoder stack does not take the GGUF model"
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    near_ties = []
    for prompt in PROMPTS:
        prompt_ids = packed.tokenizer.encode(prompt, add_special_tokens=False)
        engine.add_request(prompt_ids, params)
        tokens = []
        while engine.has_work():
            tokens += [output.token_id for output in engine.step() if output.token_id is not None]
        assert len(tokens) == NEW_TOKENS
        ids = prompt_ids + tokens
        dense_logits = logits(dense, ids)
        theirs = dense_logits[len(prompt_ids) - 1 : -1]
        delta = (logits(rounded, ids) - dense_logits).abs().max().item()
        for position, (token, row) in enumerate(zip(tokens, theirs, strict=True)):
            best = int(row.argmax())
            if token != best:
                gap = (row[best] - row[token]).item()
                near_ties.append((prompt[:20], position, gap))
                assert gap <= 2 * delta, (
                    f"{prompt!r} token {position}: {token} where the dense model's {best} leads by {gap}"
                )
    assert engine.core.runner.cpu_decode.num_steps > 0, "the C decoder stack did not run"
    print(f"near ties where the packed model chose another token: {near_ties}")


@pytest.fixture
def no_c_compiler(monkeypatch, tmp_path):
    """As on a machine without a C compiler: $CC names no file, so no C kernel builds (a build
    asks the compiler its version before it looks for a library built before)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    load_native.cache_clear()
    yield
    load_native.cache_clear()  # what loads next, after monkeypatch's undo, finds the real kernels


@pytest.mark.parametrize("without", ["a C compiler", "the C kernels"])
def test_without_its_c_kernel_a_packed_model_runs_its_weights_dequantized_once(models, request, without):
    """Dequantized at every call, the weights of a decode step cost more than the step (SmolLM2's
    Q4_1 file decoded at a quarter of transformers' speed): without the C kernel the policy
    dequantizes each weight once, and the packed model computes what the dense model does."""
    packed, dense, _ = models
    if without == "a C compiler":
        request.getfixturevalue("no_c_compiler")
    policy = KernelPolicy("cpu", use_native_cpu_kernels=without != "the C kernels")
    model = apply_kernel_policy(copy.deepcopy(packed.model), policy)
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    assert linears and all(isinstance(linear.method, DequantizedGgufMethod) for linear in linears)
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8  # the blocks are kept
    for prompt in PROMPTS:
        ids = packed.tokenizer.encode(prompt, add_special_tokens=False)
        assert torch.equal(logits(model, ids), logits(dense, ids))
