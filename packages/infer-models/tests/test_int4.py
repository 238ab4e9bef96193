"""4-bit weights: GPTQ and AWQ checkpoints as published, and round-to-nearest int4 at load.

The oracles: for a checkpoint, its tensors dequantized by a transcription (below) of the code the
formats' own libraries dequantize with, element by element; for int4 at load, a plain loop over
each row's groups. Our loaded weights, dequantized by infer.kernels' reference, must equal the
former exactly; our logits must be transformers' on the dequantized weights written as a dense
fp32 checkpoint, to fp32 rounding (specs/parity/tolerances.yaml, float32: both sides compute in
fp32 from the same weights and differ by summation order).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from infer.kernels import dequantize_int4
from infer.models import int4_weights, quantization
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.loader.weights import CheckpointError
from infer.models.quantization import QuantizationConfigError, parse_quantization_config, resolve_quantization
from infer.models.random_checkpoint import QUANTIZATION_CONFIGS, make_random_checkpoint

PRESETS = ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]
# specs/parity/tolerances.yaml, float32.
MAX_ABS, MEAN_ABS = 1.0e-3, 1.0e-4
PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# The checkpoints under test: (format, entries replacing the written quantization_config).
FORMATS = {
    "gptq-sym": ("gptq", None),  # GPTQModel's default: symmetric, v1
    "gptq-act-order": ("gptq", {"desc_act": True}),
    "gptq-asym-v1": ("gptq", {"sym": False}),
    "gptq-asym-v2": ("gptq", {"sym": False, "checkpoint_format": "gptq_v2"}),
    "awq": ("awq", None),
}


# --- the oracles: the formats' own dequantization, transcribed -----------------------------------


def gptq_dequantize(tensors: dict[str, torch.Tensor], raw: dict) -> torch.Tensor:
    """[N, K] float32 from a GPTQ Linear's `qweight`, `qzeros`, `scales`, `g_idx`, as GPTQModel
    2.2.0 computes it: `convert_gptq_v1_to_v2_format_module` (gptqmodel/utils/model.py) adds
    0b00010001000100010001000100010001 to every qzeros word of a v1 checkpoint (bits 4), then
    `BaseQuantLinear.dequantize_weight` (gptqmodel/nn_modules/qlinear/__init__.py) unpacks with
    wf = range(0, 32, 4) and forms `scales[g_idx] * (weight - zeros[g_idx])`, transposed by the
    layer's `matmul(x, weights)`. In float32 here where GPTQModel uses the scales' float16: each
    product of a float16 scale and an integer below 16 is exact in float32."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"].clone(), tensors["scales"]
    g_idx = tensors.get("g_idx")
    if raw.get("checkpoint_format", "gptq") == "gptq":
        qzeros += 0b00010001000100010001000100010001
    wf = torch.tensor(list(range(0, 32, 4)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 8), wf.unsqueeze(0)).to(
        torch.int8
    )
    zeros = torch.bitwise_and(zeros, 15).reshape(scales.shape)
    weight = torch.bitwise_and(
        torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 8, -1), wf.unsqueeze(-1)).to(
            torch.int8
        ),
        15,
    )
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    if g_idx is None:
        g_idx = torch.arange(weight.shape[0]) // raw["group_size"]
    weights = scales.float()[g_idx.long()] * (weight - zeros[g_idx.long()])
    return weights.t()


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_dequantize(tensors: dict[str, torch.Tensor], raw: dict) -> torch.Tensor:
    """[N, K] float32 from an AWQ Linear's `qweight`, `qzeros`, `scales`, as AutoAWQ 0.2.9
    computes it (awq/utils/packing_utils.py: `unpack_awq`, `reverse_awq_order`,
    `dequantize_gemm`), transposed as WQLinear_GEMM's `x @ W` takes it; float32 as above."""
    qweight, qzeros, scales, bits = tensors["qweight"], tensors["qzeros"], tensors["scales"], 4
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse_order_tensor = torch.arange(iweights.shape[-1], dtype=torch.int32)
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER].view(-1)
    izeros, iweights = izeros[:, reverse_order_tensor], iweights[:, reverse_order_tensor]
    iweights = torch.bitwise_and(iweights, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)
    group_size = raw["group_size"]
    scales = scales.float().repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweights - izeros) * scales).t()


ORACLES = {"gptq": gptq_dequantize, "awq": awq_dequantize}


def independent_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """`weight` rounded to nearest on each group's asymmetric 4-bit grid and dequantized, by loops:
    the group's range (holding 0) in 15 steps, a zero point round(-min / step)."""
    out = torch.empty_like(weight)
    for row in range(weight.shape[0]):
        for first in range(0, weight.shape[1], group_size):
            group = weight[row, first : first + group_size]
            low, high = min(group.min().item(), 0.0), max(group.max().item(), 0.0)
            step = torch.tensor((high - low) / 15 if high > low else 1.0, dtype=torch.float32)
            zero = torch.round(-low / step).clamp(0, 15)
            q = (torch.round(group / step) + zero).clamp(0, 15)
            out[row, first : first + group_size] = (q - zero) * step
    return out


def load_group_size(in_features: int) -> int:
    """The group int4 at load takes for this many inputs (infer.models.quantization.int4_group_for)."""
    group = 128
    while in_features % group:
        group //= 2
    return group


# --- helpers -------------------------------------------------------------------------------------


def checkpoint_linears(folder) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The checkpoint's 4-bit Linears (its module name -> suffix -> tensor) and quantization_config."""
    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    linears: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("qweight", "qzeros", "scales", "g_idx"):
            linears.setdefault(module, {})[suffix] = tensor
    return linears, raw


def write_dense(folder, out, weights: dict[str, torch.Tensor]):
    """A dense fp32 copy of `folder` for transformers, the 4-bit Linears replaced by `weights`."""
    out.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        if suffix not in ("qweight", "qzeros", "scales", "g_idx"):
            tensors[name] = tensor.float()
    tensors.update({name: w.contiguous() for name, w in weights.items()})
    save_file(tensors, out / "model.safetensors")
    return out


def dequantized_checkpoint(folder, out):
    linears, raw = checkpoint_linears(folder)
    oracle = ORACLES[raw["quant_method"]]
    return write_dense(folder, out, {f"{m}.weight": oracle(t, raw) for m, t in linears.items()})


def our_dequantized(linear) -> torch.Tensor:
    """A 4-bit Linear's weight as infer.kernels' reference reads it, in the checkpoint's column order."""
    dense = dequantize_int4(linear.weight, linear.weight_scale, linear.weight_zero, linear.group_size)
    if linear.input_perm is None:
        return dense
    restored = torch.empty_like(dense)
    restored[:, linear.input_perm] = dense
    return restored


@torch.no_grad()
def assert_logits_match(ours, reference):
    generator = torch.Generator().manual_seed(0)
    batch_prompts = [
        torch.randint(0, ours.config.vocab_size, (n,), generator=generator).tolist() for n in (3, 11)
    ]
    batch = ForwardBatch.from_tokens(batch_prompts)
    logits = batch.rows(ours.compute_logits(ours(batch)))
    for row, prompt in enumerate(batch_prompts):
        expected = reference(torch.tensor([prompt])).logits[0]
        difference = (logits[row] - expected).abs()
        assert difference.max().item() <= MAX_ABS and difference.mean().item() <= MEAN_ABS, difference.max()
        assert torch.equal(logits[row].argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module", params=[(p, f) for p in PRESETS for f in FORMATS], ids=str)
def int4_checkpoint(request, tmp_path_factory):
    preset, name = request.param
    method, overrides = FORMATS[name]
    root = tmp_path_factory.mktemp(f"{preset}-{name}")
    folder = make_random_checkpoint(
        preset, root / "q", dtype=torch.float32, quantization=method, quantization_config=overrides
    )
    return name, folder, dequantized_checkpoint(folder, root / "dense")


# --- the formats ---------------------------------------------------------------------------------


def test_published_int4_configs_parse():
    # As GPTQModel and AutoAWQ write them (Qwen/Qwen3-8B-AWQ's, with its group_size 128).
    gptq = parse_quantization_config(QUANTIZATION_CONFIGS["gptq"])
    assert (gptq.method, gptq.group_size, gptq.symmetric, gptq.act_order, gptq.zero_offset) == (
        "gptq", 128, True, False, 1,
    )  # fmt: skip
    v2 = parse_quantization_config(
        {**QUANTIZATION_CONFIGS["gptq"], "checkpoint_format": "gptq_v2", "group_size": -1}
    )
    assert (v2.zero_offset, v2.group_size) == (0, None)
    awq = parse_quantization_config(QUANTIZATION_CONFIGS["awq"])
    assert (awq.method, awq.group_size, awq.symmetric, awq.is_int4) == ("awq", 128, False, True)
    assert not awq.quantizes("lm_head") and awq.quantizes("layers.0.mlp.down_proj")


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 4"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "LM head"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemm"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "awq", "bits": 4, "group_size": 7}, "group_size"),
    ],
)
def test_int4_formats_we_do_not_read_are_refused_by_name(raw, named):
    with pytest.raises(QuantizationConfigError, match=named):
        parse_quantization_config(raw)


def test_int4_asks_for_a_4bit_checkpoint_as_stored_and_quantizes_a_dense_one():
    gptq = parse_quantization_config(QUANTIZATION_CONFIGS["gptq"])
    assert resolve_quantization(gptq, "int4") is gptq
    with pytest.raises(QuantizationConfigError, match="cannot be loaded as int8"):
        resolve_quantization(gptq, "int8")
    at_load = resolve_quantization(None, "int4")
    assert (at_load.method, at_load.group_size, at_load.in_checkpoint) == ("int4", 128, False)
    # SmolLM2's 576 inputs are 4.5 groups of 128: groups of 64.
    assert quantization.int4_group_for(at_load, 576, "layers.0.self_attn.qkv_proj") == 64
    with pytest.raises(QuantizationConfigError, match="layers.0.mlp.down_proj"):
        quantization.int4_group_for(at_load, 200, "layers.0.mlp.down_proj")


# --- loading checkpoints -------------------------------------------------------------------------


def test_each_loaded_weight_is_the_formats_own_dequantization(int4_checkpoint):
    """Our repacked weights, dequantized, equal the format library's dequantization bit for bit."""
    name, folder, _ = int4_checkpoint
    ours = load_causal_lm(folder, dtype=torch.float32)
    linears, raw = checkpoint_linears(folder)
    oracle = ORACLES[raw["quant_method"]]
    act_order_seen = False
    for index, layer in enumerate(ours.layers):
        for fused, parts in PROJECTIONS.items():
            linear = layer.get_submodule(fused)
            assert linear.weight.dtype == torch.uint8 and linear.weight_scale.dtype == torch.float16
            assert (linear.weight_zero is None) == (name in ("gptq-sym", "gptq-act-order"))
            act_order_seen |= linear.input_perm is not None
            expected = torch.cat([oracle(linears[f"model.layers.{index}.{part}"], raw) for part in parts])
            assert torch.equal(our_dequantized(linear), expected), f"layers.{index}.{fused}"
    # Act-order permutes some Linear's columns (not all: one group a row needs no order).
    assert act_order_seen == (name == "gptq-act-order")
    assert ours.lm_head.group_size is None and ours.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_4bit_checkpoint_gives_the_logits_of_its_dequantized_weights(int4_checkpoint, backend, monkeypatch):
    monkeypatch.setenv("INFER_KERNELS_BACKEND", backend)
    _, folder, dense = int4_checkpoint
    ours = load_causal_lm(folder, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, attn_implementation="eager")
    assert_logits_match(ours, reference.eval())


def test_a_checkpoints_4bit_tensors_are_checked_before_reading(tmp_path):
    folder = make_random_checkpoint("qwen3-tiny", tmp_path / "q", dtype=torch.float32, quantization="awq")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    tensors["model.layers.1.self_attn.q_proj.scales"] = tensors["model.layers.1.self_attn.q_proj.scales"][:1]
    tensors["model.layers.1.mlp.down_proj.qweight"] = tensors["model.layers.1.mlp.down_proj.qweight"].float()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_causal_lm(folder, dtype=torch.float32)
    message = str(error.value)
    assert "missing tensors: model.layers.0.mlp.up_proj.qzeros" in message
    assert "model.layers.1.self_attn.q_proj.scales: expected [2, 128], got [1, 128]" in message
    assert "model.layers.1.mlp.down_proj.qweight: expected I32, got F32" in message


def test_act_order_parts_of_one_input_must_share_their_column_order(tmp_path):
    folder = make_random_checkpoint(
        "qwen3-tiny", tmp_path / "q", dtype=torch.float32, quantization="gptq",
        quantization_config={"desc_act": True},
    )  # fmt: skip
    tensors = load_file(folder / "model.safetensors")
    g_idx = tensors["model.layers.0.self_attn.k_proj.g_idx"]
    tensors["model.layers.0.self_attn.k_proj.g_idx"] = torch.arange(g_idx.shape[0], dtype=torch.int32) // 32
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="g_idx.*differ"):
        load_causal_lm(folder, dtype=torch.float32)


# --- int4 at load --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [None, 3 * 256 * 4])
def test_int4_at_load_puts_every_weight_within_half_a_step(scale_dtype, chunk_bytes, monkeypatch):
    if chunk_bytes is not None:  # a few rows a chunk, the last chunk partial
        monkeypatch.setattr(quantization, "QUANTIZE_CHUNK_BYTES", chunk_bytes)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 256, generator=generator) * torch.rand(37, 1, generator=generator)
    weight[3, :64] = 0  # an all-zero group
    weight[5, 64:128] = weight[5, 64:128].abs() + 0.5  # a group above 0
    packed = int4_weights.quantize_int4(weight, 64, scale_dtype)
    assert packed.qweight.shape == (37, 128) and packed.scales.dtype == scale_dtype
    restored = dequantize_int4(packed.qweight, packed.scales, packed.zeros, 64)
    step = packed.scales.float().repeat_interleave(64, dim=1)
    error = (restored.double() - weight.double()).abs()
    # Half a step, with room for float32's rounding of w / step.
    assert (error <= step.double() * (0.5 + 2**-20)).all(), (error / step).max()
    assert torch.equal(restored[3, :64], torch.zeros(64))


@pytest.mark.parametrize("preset", PRESETS)
def test_int4_at_load_gives_the_logits_of_an_independent_quantization(preset, tmp_path):
    folder = make_random_checkpoint(preset, tmp_path / "dense", dtype=torch.float32)
    ours = load_causal_lm(folder, dtype=torch.float32, quantization="int4")
    # Every projection 4-bit; the embedding and the LM head (tied or not) as they were.
    assert ours.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    assert ours.lm_head.group_size is None and ours.lm_head.weight.dtype == torch.float32
    tensors = load_file(folder / "model.safetensors")
    restored = {}
    for name, tensor in tensors.items():
        if name.endswith(("_proj.weight",)):
            restored[name] = independent_int4(tensor, load_group_size(tensor.shape[1]))
    reference = AutoModelForCausalLM.from_pretrained(
        write_dense(folder, tmp_path / "oracle", restored), dtype=torch.float32, attn_implementation="eager"
    )
    assert_logits_match(ours, reference.eval())


# --- the published layouts we write --------------------------------------------------------------


def test_the_written_4bit_layouts_are_those_of_the_published_checkpoints(tmp_path):
    folder = make_random_checkpoint(
        "qwen3-tiny", tmp_path / "gptq", quantization="gptq", quantization_config={"desc_act": True}
    )
    tensors = load_file(folder / "model.safetensors")
    # qwen3-tiny: 64 inputs, q_proj 128 rows; groups of 32 (160-wide down_proj inputs).
    q_proj = {
        k.rpartition(".")[2]: v
        for k, v in tensors.items()
        if k.startswith("model.layers.0.self_attn.q_proj.")
    }
    assert {suffix: (tuple(v.shape), v.dtype) for suffix, v in q_proj.items()} == {
        "qweight": ((8, 128), torch.int32),
        "qzeros": ((2, 16), torch.int32),
        "scales": ((2, 128), torch.float16),
        "g_idx": ((64,), torch.int32),
    }  # fmt: skip
    assert sorted(torch.bincount(tensors["model.layers.0.self_attn.q_proj.g_idx"]).tolist()) == [32, 32]
    assert "lm_head.weight" not in tensors and tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    awq = load_file(
        make_random_checkpoint("qwen3-tiny", tmp_path / "awq", quantization="awq") / "model.safetensors"
    )
    assert tuple(awq["model.layers.0.self_attn.q_proj.qweight"].shape) == (64, 16)
    assert "model.layers.0.self_attn.q_proj.g_idx" not in awq
