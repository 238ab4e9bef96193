"""One decoder block at a time against transformers' own block with the same weights and input
(fp32, CPU), the RoPE tables against transformers' rotary embeddings, and activation_diff."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from infer.kernels import rope_tables
from infer.models.activation_diff import activation_diffs, block_output, first_departure
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.random_checkpoint import PRESETS, make_random_checkpoint

# fp32 on both sides: only summation order differs.
ATOL = RTOL = 2e-5


@pytest.fixture(scope="module", params=["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def pair(request, tmp_path_factory):
    """(ours, transformers) for one tiny random checkpoint, both fp32."""
    folder = make_random_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), dtype=torch.float32
    )
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return load_causal_lm(folder, dtype=torch.float32), reference.eval()


def _additive_mask(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """transformers' eager mask for this batch's own keys: 0 where visible, -inf elsewhere."""
    q, k = positions[:, :, None], positions[:, None, :]
    visible = k <= q
    if window is not None:
        visible &= q - k < window
    return torch.where(visible, 0.0, float("-inf"))[:, None]


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_decoder_block_matches_transformers(pair, layer_idx):
    ours, reference = pair
    config = ours.config
    generator = torch.Generator().manual_seed(layer_idx)
    x = torch.randn(2, 10, config.hidden_size, generator=generator)
    # Row 1 starts at position 5: RoPE and the window see positions past the first rows.
    positions = torch.stack([torch.arange(10), torch.arange(5, 15)])
    # Our block takes the two rows back to back, [20, hidden]; transformers' takes [2, 10, hidden].
    batch = ForwardBatch.from_tokens([[0] * 10, [0] * 10], start_positions=[0, 5])

    with torch.no_grad():
        hidden, residual = ours.layers[layer_idx](x.flatten(0, 1).clone(), None, batch)
        layer_type = config.layer_types[layer_idx]
        rotary_args = (layer_type,) if config.model_type.startswith("gemma3") else ()
        expected = reference.model.layers[layer_idx](
            x,
            attention_mask=_additive_mask(positions, config.sliding_window_for_layer(layer_idx)),
            position_ids=positions,
            position_embeddings=reference.model.rotary_emb(x, positions, *rotary_args),
        )
    output = block_output(ours.layers[layer_idx], hidden, residual)
    torch.testing.assert_close(output.view_as(x), expected, atol=ATOL, rtol=RTOL)


def test_llama3_scaled_rope_tables_match_transformers():
    hf_config = LlamaConfig(**PRESETS["llama-3.2-1b"].config)
    positions = torch.arange(2048)[None]
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(64, 2048, 500000.0, scaling=hf_config.rope_parameters)
    # transformers multiplies position x frequency in fp32: ~2e-4 rad of rounding at position 2047.
    torch.testing.assert_close(cos, hf_cos[0, :, :32], atol=5e-4, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, :32], atol=5e-4, rtol=0)


@pytest.mark.parametrize("layer_type, base", [("sliding_attention", 1e4), ("full_attention", 1e6)])
def test_gemma_local_and_global_rope_tables_match_transformers(layer_type, base):
    hf_config = Gemma3TextConfig(**PRESETS["gemma-3-1b"].config)
    positions = torch.arange(1024)[None]
    hf_cos, _ = Gemma3RotaryEmbedding(hf_config)(torch.zeros(1), positions, layer_type)
    cos, _ = rope_tables(256, 1024, base)
    torch.testing.assert_close(cos, hf_cos[0, :, :128], atol=5e-4, rtol=0)


def test_activation_diff_marks_the_first_block_that_departs(pair):
    ours, reference = pair
    input_ids = torch.randint(0, ours.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert first_departure(activation_diffs(ours, reference, input_ids), rel_tol=1e-4) is None

    # Damage one input column of block 1's MLP (a scale alone would vanish in Gemma's post-norm).
    gate_up = ours.layers[1].mlp.gate_up_proj.weight
    original = gate_up.clone()
    try:
        with torch.no_grad():
            gate_up[:, 0] += 1.0
        diffs = activation_diffs(ours, reference, input_ids)
    finally:
        with torch.no_grad():
            gate_up.copy_(original)
    # Stages: embeddings, layer 0, layer 1, ...: the damaged block is stage 2.
    assert diffs[first_departure(diffs, rel_tol=1e-4)].name == "layer 1"
