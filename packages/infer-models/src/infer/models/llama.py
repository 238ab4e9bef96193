"""Llama 3 (and SmolLM2, which shares the architecture): pre-norm blocks, GQA, SwiGLU."""

import torch
from torch import nn

from infer.models.common import Attention, CausalLM, GatedMLP, RMSNorm, RotaryEmbedding
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch


class LlamaDecoderLayer(nn.Module):
    qk_norm_offset: float | None = None

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary, qk_norm_offset=self.qk_norm_offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
            qkv = self.self_attn.qkv_proj(hidden)
        else:
            qkv, residual = self.input_layernorm.project(hidden, residual, self.self_attn.qkv_proj)
        hidden = self.self_attn.attend(qkv, batch)
        return self.mlp.after_norm(self.post_attention_layernorm, hidden, residual)


class LlamaForCausalLM(CausalLM):
    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(config, layer_idx, rotary)
