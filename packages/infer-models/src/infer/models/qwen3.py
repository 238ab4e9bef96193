"""Qwen 3 (dense): the Llama block plus an RMSNorm over each query and key head before RoPE."""

from torch import nn

from infer.models.common import CausalLM, RotaryEmbedding
from infer.models.config import ModelConfig
from infer.models.llama import LlamaDecoderLayer


class Qwen3DecoderLayer(LlamaDecoderLayer):
    qk_norm_offset = 0.0


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return Qwen3DecoderLayer(config, layer_idx, rotary)
