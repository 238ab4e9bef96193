"""Llama 3 (and SmolLM2, which shares the architecture): pre-norm blocks, GQA, SwiGLU."""

import torch
from torch import nn

from infer.models.common import Attention, CausalLM, GatedMLP, RMSNorm, RotaryEmbedding
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch
from infer.models.prenorm import PreNormProjection


class LlamaDecoderLayer(nn.Module):
    qk_norm_offset: float | None = None

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary, qk_norm_offset=self.qk_norm_offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        # Each norm with the projection after it, as one module (infer.models.prenorm).
        self.attention_input = PreNormProjection(self.input_layernorm, self.self_attn.qkv_proj)
        activation = self.mlp.activation_name
        self.mlp_input = PreNormProjection(
            self.post_attention_layernorm, self.mlp.gate_up_proj, activation=activation
        )

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.attention_input(hidden, residual)  # input_layernorm, q|k|v
        hidden = self.self_attn(qkv, batch)
        gated, residual = self.mlp_input(hidden, residual)  # post_attention_layernorm, act(gate) * up
        return self.mlp.down_proj(gated), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(config, layer_idx, rotary)
