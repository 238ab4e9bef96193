"""Qwen3-VL's language model: Qwen 3 with multimodal rotary positions and DeepStack.

The decoder is Qwen 3's (QK norm, SwiGLU); its rotation takes each token's (t, h, w) positions
where the batch has them (`ForwardBatch.mrope_positions`, infer.models.mrope). An image's
embeddings arrive as the vision tower's rows (infer.models.qwen3_vl_vision):
`[M, hidden * (1 + num_deepstack)]`, the merger's embedding first, which takes the place of the
image token, then one DeepStack embedding per level, which is added to the hidden states at the
image tokens after decoder layer `level` (DeepStack, arXiv:2406.04334, as transformers'
Qwen3VLTextModel does). The image tokens attend causally, like text.
"""

import dataclasses

import torch
from torch import nn

from infer.models.common import CausalLM, RotaryEmbedding
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch
from infer.models.mrope import MRotaryEmbedding
from infer.models.qwen3 import Qwen3DecoderLayer

# Where Qwen3VLForConditionalGeneration checkpoints keep the language model, and the tower the
# decoder's loader skips (infer.models.qwen3_vl_vision loads it).
CHECKPOINT_PREFIXES = ("model.language_model.",)
IGNORED_PREFIXES = ("model.visual.",)


class Qwen3VLForCausalLM(CausalLM):
    rotary_class = MRotaryEmbedding

    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return Qwen3DecoderLayer(config, layer_idx, rotary)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """CausalLM.forward, with the image rows' DeepStack embeddings added after the first
        layers."""
        deepstack = None
        if batch.image_embeds is not None:
            width = self.config.hidden_size
            deepstack = batch.image_embeds[:, width:].unflatten(-1, (-1, width))  # [M, levels, hidden]
            batch = dataclasses.replace(batch, image_embeds=batch.image_embeds[:, :width])
        hidden, residual = self.embed(batch.input_ids, batch), None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, batch)
            if deepstack is not None and index < deepstack.shape[1]:
                # The layer's output is hidden + residual: adding to either adds to the sum.
                level = deepstack[:, index].to(hidden.dtype)
                hidden = hidden.index_add(0, batch.image_token_indices, level)
        if batch.logits_indices is not None:
            hidden, residual = hidden[batch.logits_indices], residual[batch.logits_indices]
        hidden, _ = self.norm(hidden, residual)
        return hidden
