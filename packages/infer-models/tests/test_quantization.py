"""8-bit weights (FP8 block-wise, INT8 per channel): the checkpoint formats, their loading, and
quantizing at load.

The oracle for a quantized model is transformers running the same checkpoint dequantized by
plain torch in this file (weight * scale, each scale repeated over its block), written as a dense
fp32 checkpoint: our model must give its logits. Tiny shapes make the fp8 blocks partial (64-wide
layers in 128x128 blocks) and the fused q/k/v parts misaligned with them (32-row k and v).
"""

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from infer.models import quantization
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch
from infer.models.int4_weights import quantize_int4
from infer.models.load import load_causal_lm
from infer.models.loader.weights import CheckpointError
from infer.models.quantization import (
    Quantization,
    QuantizationConfigError,
    parse_quantization_config,
    quantize_weight,
    resolve_quantization,
)
from infer.models.random_checkpoint import QUANTIZATION_CONFIGS, make_random_checkpoint

PRESETS = ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]
# Both sides compute in fp32 from the same dequantized weights: they differ by summation order.
ATOL = RTOL = 2e-5
SCALE_NAMES = {"fp8": "weight_scale_inv", "int8": "weight_scale"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """W = weight * scale over blocks of 128x128 (fp8) or rows (int8), the last block of a
    dimension possibly partial: plain torch, independent of infer.kernels."""
    rows, cols = (128, 128) if method == "fp8" else (1, weight.shape[1])
    expanded = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return weight.float() * expanded[: weight.shape[0], : weight.shape[1]]


def write_dequantized(folder, out):
    """A dense fp32 copy of a quantized checkpoint folder, for transformers."""
    out.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    method = "fp8" if config.pop("quantization_config")["quant_method"] == "fp8" else "int8"
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    dense = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_NAMES[method]):
            continue
        scale = tensors.get(name.removesuffix("weight") + SCALE_NAMES[method])
        dense[name] = tensor.float() if scale is None else dequantize(tensor, scale, method)
    save_file(dense, out / "model.safetensors")
    return out


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 11)]


@torch.no_grad()
def assert_logits_match(ours, reference, *, relative_to_max: float | None = None):
    """Each prompt's logits as transformers gives them: to fp32 rounding, or within
    `relative_to_max` of the largest logit."""
    batch_prompts = prompts(ours.config.vocab_size)
    batch = ForwardBatch.from_tokens(batch_prompts)
    logits = batch.rows(ours.compute_logits(ours(batch)))
    for row, prompt in enumerate(batch_prompts):
        expected = reference(torch.tensor([prompt])).logits[0]
        if relative_to_max is None:
            torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=RTOL)
        else:
            error = (logits[row] - expected).abs().max().item()
            assert error <= relative_to_max * expected.abs().max().item(), error


@pytest.fixture(scope="module", params=[(p, m) for p in PRESETS for m in ("fp8", "int8")], ids=str)
def quantized_checkpoint(request, tmp_path_factory):
    preset, method = request.param
    root = tmp_path_factory.mktemp(f"{preset}-{method}")
    folder = make_random_checkpoint(preset, root / "q", dtype=torch.float32, quantization=method)
    return method, folder, write_dequantized(folder, root / "dense")


# --- the formats ---------------------------------------------------------------------------------


def test_the_written_layouts_are_those_of_the_published_checkpoints(quantized_checkpoint):
    method, folder, _ = quantized_checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIGS[method]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            tensor = f.get_tensor(name)
            if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
                assert tensor.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int8), name
                scale = f.get_tensor(name.removesuffix("weight") + SCALE_NAMES[method])
                assert scale.dtype == torch.float32
                out_rows, in_cols = tensor.shape
                expected = (
                    (math.ceil(out_rows / 128), math.ceil(in_cols / 128))
                    if method == "fp8"
                    else (out_rows, 1)
                )
                assert tuple(scale.shape) == expected, name
            elif not name.endswith(SCALE_NAMES[method]):
                # Embeddings, norms and the LM head stay in the checkpoint's dtype.
                assert tensor.dtype == torch.float32, name
    assert (
        sum(n.endswith(SCALE_NAMES[method]) for n in names) == len(PROJECTIONS) * config["num_hidden_layers"]
    )


def test_a_quantized_checkpoint_holds_the_dense_one_of_its_seed_quantized(tmp_path):
    dense = make_random_checkpoint("llama-tiny", tmp_path / "dense", dtype=torch.float32)
    dense_tensors = load_file(dense / "model.safetensors")
    for method, tolerance in (("int8", 0.5 / 127), ("fp8", 2.0**-4)):
        folder = make_random_checkpoint(
            "llama-tiny", tmp_path / method, dtype=torch.float32, quantization=method
        )
        tensors = load_file(folder / "model.safetensors")
        weight = "model.layers.1.mlp.down_proj.weight"
        scale = tensors[weight.removesuffix("weight") + SCALE_NAMES[method]]
        restored = dequantize(tensors[weight], scale, method)
        # Within half an int8 step, or fp8's relative rounding, of each block's largest weight.
        error = (restored - dense_tensors[weight]).abs().max()
        assert 0 < error <= tolerance * dense_tensors[weight].abs().max()
        torch.testing.assert_close(tensors["model.norm.weight"], dense_tensors["model.norm.weight"])


def test_published_quantization_configs_parse():
    fp8 = parse_quantization_config(QUANTIZATION_CONFIGS["fp8"])
    assert (fp8.method, fp8.block_size, fp8.scale_name, fp8.in_checkpoint) == (
        "fp8", (128, 128), "weight_scale_inv", True
    )  # fmt: skip
    int8 = parse_quantization_config(QUANTIZATION_CONFIGS["int8"])
    assert (int8.method, int8.block_size, int8.scale_name) == ("int8", None, "weight_scale")
    assert int8.block_for(576) == (1, 576)
    assert not int8.quantizes("lm_head") and int8.quantizes("layers.0.mlp.down_proj")
    assert parse_quantization_config(None) is None


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}}
                },
            },
            "channel",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
                },
            },
            "pack-quantized",
        ),
    ],
)
def test_formats_we_do_not_read_are_refused_by_name(raw, named):
    with pytest.raises(QuantizationConfigError, match=named):
        parse_quantization_config(raw)


def test_requested_quantization_meets_the_checkpoints():
    fp8 = parse_quantization_config(QUANTIZATION_CONFIGS["fp8"])
    assert resolve_quantization(fp8, None) is fp8
    assert resolve_quantization(fp8, "fp8") is fp8
    with pytest.raises(QuantizationConfigError, match="cannot be loaded as int8"):
        resolve_quantization(fp8, "int8")
    assert resolve_quantization(None, None) is None
    at_load = resolve_quantization(None, "int8")
    assert at_load == Quantization("int8", None, in_checkpoint=False)
    assert at_load.quantizes("lm_head")
    with pytest.raises(QuantizationConfigError, match="int3"):
        resolve_quantization(None, "int3")


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["whole", "a-block-row-at-a-time"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("block_size", [(1, 200), (128, 128), (1, 128)])
def test_quantize_weight_rounds_each_weight_to_its_blocks_grid(method, block_size, chunk_bytes, monkeypatch):
    if chunk_bytes is not None:
        monkeypatch.setattr(quantization, "QUANTIZE_CHUNK_BYTES", chunk_bytes)
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    weight[:, 7] = 0  # a zero column, and below an all-zero block
    weight[256:, 128:] = 0
    quantized, scale = quantize_weight(weight, method, block_size)
    assert quantized.dtype == (torch.int8 if method == "int8" else torch.float8_e4m3fn)
    assert scale.shape == (math.ceil(300 / block_size[0]), math.ceil(200 / block_size[1]))
    restored = (
        quantized.float()
        * scale.repeat_interleave(block_size[0], 0).repeat_interleave(block_size[1], 1)[:300, :200]
    )
    per_weight = scale.repeat_interleave(block_size[0], 0).repeat_interleave(block_size[1], 1)[:300, :200]
    if method == "int8":
        assert ((restored - weight).abs() <= per_weight / 2 + 1e-7).all()
    else:  # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (or of the smallest normal)
        assert ((restored - weight).abs() <= (weight.abs() * 2.0**-4).clamp_min(per_weight * 2.0**-9)).all()
    # Each block's largest weight lands on the format's largest value.
    assert quantized.float().abs().max() == (127 if method == "int8" else 448)
    assert restored[256:, 128:].abs().max() == 0


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantizing_in_chunks_gives_the_bits_of_quantizing_whole(method, monkeypatch):
    weight = torch.randn(1000, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = quantize_weight(weight, method, (128, 128))
    # Three block rows a chunk: chunks of 384 rows, the last one partial.
    monkeypatch.setattr(quantization, "QUANTIZE_CHUNK_BYTES", 3 * 128 * 384 * 4)
    chunked = quantize_weight(weight, method, (128, 128))
    assert torch.equal(chunked[0].view(torch.int8), whole[0].view(torch.int8))
    assert torch.equal(chunked[1], whole[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weight_device", ["cuda", "cpu"])
@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantizing_a_large_weight_on_cuda_peaks_near_its_quantized_size(method, weight_device):
    """Issue 55: quantizing at load made float32 temporaries of the whole weight (2.3 GiB for a
    qwen3-8b LM head in bf16, an OOM under --device-memory-limit-gib 16). int4 (which keeps the
    LM head dense, but quantizes MLP weights of 12288 x 4096) packs each chunk as it is made. A
    weight on the host (as the loader reads it) is never on the device whole: the peak is the
    same bound without the weight."""
    weight = torch.randn(151936, 4096, device=weight_device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if method == "int4":
        packed = quantize_int4(weight, 128, torch.bfloat16, device="cuda")
        assert packed.qweight.is_cuda and packed.scales.is_cuda and packed.zeros.is_cuda
        output = packed.qweight.numel() + packed.scales.numel() * 2 + packed.zeros.numel()
    else:
        quantized, scale = quantize_weight(weight, method, (128, 128), "cuda")
        assert quantized.is_cuda and scale.is_cuda
        output = quantized.numel() + scale.numel() * 4
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # The output, and a chunk's temporaries: a few float32 copies of QUANTIZE_CHUNK_BYTES.
    assert extra <= output + 6 * quantization.QUANTIZE_CHUNK_BYTES, (extra, output)


# --- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_quantized_checkpoint_gives_the_logits_of_its_dequantized_weights(
    quantized_checkpoint, backend, monkeypatch
):
    """With the references (INFER_KERNELS_BACKEND=torch) both sides compute in fp32 from the same
    weights. By default int8 on a CPU takes ATen's int8 kernel, which rounds each Linear's input
    and scales to bf16 (int8_linear_cpu): the logits then stay within 2^-6 of their largest."""
    method, folder, dense = quantized_checkpoint
    monkeypatch.setenv("INFER_KERNELS_BACKEND", backend)
    ours = load_causal_lm(folder, dtype=torch.float32)
    assert ours.quantization.method == method
    qkv = ours.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int8)
    # fp8's 128-row blocks split q | k | v mid-block here, so the fused scales are kept per row.
    assert qkv.block_size == ((1, 128) if method == "fp8" else (1, qkv.in_features))
    assert ours.lm_head.weight_scale is None and ours.embed_tokens.weight.dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, attn_implementation="eager")
    if method == "int8" and backend == "auto":
        assert_logits_match(ours, reference.eval(), relative_to_max=2.0**-6)
    else:
        assert_logits_match(ours, reference.eval())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(("method", "backend"), [("int8", "auto"), ("int8", "torch"), ("fp8", "auto")])
def test_quantizing_at_load_gives_the_logits_of_an_independent_quantization(
    preset, method, backend, tmp_path, monkeypatch
):
    """As above: fp32 rounding with the references, 2^-6 of the largest logit with int8's CPU kernel."""
    monkeypatch.setenv("INFER_KERNELS_BACKEND", backend)
    folder = make_random_checkpoint(preset, tmp_path / "dense", dtype=torch.float32)
    ours = load_causal_lm(folder, dtype=torch.float32, quantization=method)
    # Every Linear is 8-bit at load, the LM head too, though it shares the embedding's table.
    assert ours.lm_head.weight.dtype.itemsize == 1 and ours.embed_tokens.weight.dtype == torch.float32
    # The oracle: the checkpoint's Linear weights quantized here, symmetric absmax per row (int8)
    # or per 128x128 block (fp8) of each fused weight (q|k|v and gate|up are quantized as one
    # tensor, so fp8's blocks may straddle two parts), then dequantized for transformers.
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    dense = dict(tensors)
    for layer in range(config["num_hidden_layers"]):
        for fused in (("self_attn", "q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"),
                      ("mlp", "gate_proj", "up_proj"), ("mlp", "down_proj")):  # fmt: skip
            names = [f"model.layers.{layer}.{fused[0]}.{part}.weight" for part in fused[1:]]
            restored = independently_quantized(torch.cat([tensors[n] for n in names]), method)
            dense.update(zip(names, restored.split([tensors[n].shape[0] for n in names]), strict=True))
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    dense["lm_head.weight"] = independently_quantized(tensors[head], method)
    config["tie_word_embeddings"] = False
    out = tmp_path / "oracle"
    out.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    (out / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in dense.items()}, out / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert_logits_match(
        ours, reference.eval(), relative_to_max=2.0**-6 if backend == "auto" and method == "int8" else None
    )


def independently_quantized(weight: torch.Tensor, method: str) -> torch.Tensor:
    """`weight` quantized and dequantized again, by loops over rows or blocks."""
    if method == "int8":
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        return (weight / scale).round().clamp(-127, 127) * scale
    out = torch.empty_like(weight)
    for r in range(0, weight.shape[0], 128):
        for c in range(0, weight.shape[1], 128):
            block = weight[r : r + 128, c : c + 128]
            scale = block.abs().max() / 448
            out[r : r + 128, c : c + 128] = (block / scale).to(torch.float8_e4m3fn).float() * scale
    return out


def _rewrite(folder, out, edit):
    """A copy of `folder` whose tensors `edit` (a dict -> dict function) has changed."""
    shutil.copytree(folder, out)
    tensors = edit(load_file(folder / "model.safetensors"))
    save_file(tensors, out / "model.safetensors")
    return out


def test_missing_misshapen_and_wrongly_typed_scales_are_named(tmp_path):
    folder = make_random_checkpoint("qwen3-tiny", tmp_path / "q", dtype=torch.float32, quantization="fp8")
    scale = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    weight = "model.layers.1.mlp.up_proj.weight"

    def drop(t):
        del t[scale]
        return t

    with pytest.raises(CheckpointError, match=f"missing tensors: {scale}"):
        load_causal_lm(_rewrite(folder, tmp_path / "a", drop))

    def reshape(t):
        t[scale] = torch.ones(2, 1)
        return t

    with pytest.raises(CheckpointError, match=rf"wrong shapes: {scale}: expected \[1, 1\], got \[2, 1\]"):
        load_causal_lm(_rewrite(folder, tmp_path / "b", reshape))

    def densify(t):
        t[weight] = t[weight].float()
        return t

    with pytest.raises(CheckpointError, match=f"wrong dtypes: {weight}: expected F8_E4M3, got F32"):
        load_causal_lm(_rewrite(folder, tmp_path / "c", densify))
    with pytest.raises(QuantizationConfigError, match="cannot be loaded as int8"):
        load_causal_lm(folder, quantization="int8")


def test_compressed_tensors_activation_scales_are_not_read_and_bf16_scales_load(tmp_path):
    """w8a8 checkpoints may carry per-layer input scales, which a weight-only run does not use,
    and store their weight scales in the model's dtype."""
    folder = make_random_checkpoint("llama-tiny", tmp_path / "q", dtype=torch.float32, quantization="int8")
    scale = "model.layers.0.mlp.down_proj.weight_scale"

    def edit(t):
        t["model.layers.0.mlp.down_proj.input_scale"] = torch.ones(1)
        t[scale] = t[scale].to(torch.bfloat16)
        return t

    ours = load_causal_lm(_rewrite(folder, tmp_path / "w8a8", edit), dtype=torch.float32)
    torch.testing.assert_close(
        ours.layers[0].mlp.down_proj.weight_scale,
        load_file(folder / "model.safetensors")[scale].to(torch.bfloat16).float(),
    )


def test_a_sharded_quantized_checkpoint_keeps_each_scale_with_its_weight(tmp_path):
    folder = make_random_checkpoint(
        "gemma3-tiny", tmp_path / "q", dtype=torch.float32, quantization="int8", shards=3
    )
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in index.items():
        if name.endswith("weight_scale"):
            assert index[name.removesuffix("_scale")] == file
    single = make_random_checkpoint("gemma3-tiny", tmp_path / "one", dtype=torch.float32, quantization="int8")
    sharded_model, single_model = load_causal_lm(folder), load_causal_lm(single)
    for (name, a), (_, b) in zip(
        sharded_model.state_dict().items(), single_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert ModelConfig.from_file(folder).quantization.method == "int8"
