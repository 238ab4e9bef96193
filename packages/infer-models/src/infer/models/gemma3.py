"""Gemma 3 text: sandwich norms around attention and MLP, (1 + w) RMSNorms, QK norm, GeGLU,
sqrt(hidden)-scaled embeddings, and interleaved sliding-window layers with their own RoPE base."""

import torch
from torch import nn

from infer.models.common import Attention, CausalLM, GatedMLP, RMSNorm, RotaryEmbedding
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch

# Gemma stores RMSNorm weights w and scales by (1 + w).
GEMMA_NORM_OFFSET = 1.0


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()

        def norm():
            return RMSNorm(config.hidden_size, config.rms_norm_eps, offset=GEMMA_NORM_OFFSET)

        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer_idx, rotary, qk_norm_offset=GEMMA_NORM_OFFSET)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = norm()

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch)
        # Attention's post-norm, the add and the MLP's pre-norm: one kernel, not two.
        hidden, residual = self.post_attention_layernorm.then_add_and_norm(
            hidden, residual, self.pre_feedforward_layernorm
        )
        # The MLP's post-norm stays unfused with the next block's input norm: a block hands on
        # (hidden, residual) whose sum is transformers' block output (activation_diff reads it).
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(CausalLM):
    norm_offset = GEMMA_NORM_OFFSET
    scale_embeddings = True

    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_idx, rotary)
