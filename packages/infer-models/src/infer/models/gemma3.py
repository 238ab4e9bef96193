"""Gemma 3 text: sandwich norms around attention and MLP, (1 + w) RMSNorms, QK norm, GeGLU,
sqrt(hidden)-scaled embeddings, and interleaved sliding-window layers with their own RoPE base."""

import torch
from torch import nn

from infer.models.common import Attention, CausalLM, GatedMLP, RMSNorm, RotaryEmbedding
from infer.models.config import ModelConfig
from infer.models.forward_batch import ForwardBatch
from infer.models.prenorm import PreNormProjection

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
        # The block hands on the MLP's output before this norm: the next block (or the final
        # norm) applies it in the same kernel as the residual add and its own norm.
        self.output_norm = self.post_feedforward_layernorm
        # Each pre-norm with the projection after it, as one module (infer.models.prenorm).
        self.attention_input = PreNormProjection(self.input_layernorm, self.self_attn.qkv_proj)
        activation = self.mlp.activation_name
        self.mlp_input = PreNormProjection(
            self.pre_feedforward_layernorm, self.mlp.gate_up_proj, activation=activation
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        pending_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output before `output_norm`, residual): `output_norm(hidden) + residual`
        is transformers' block output. `pending_norm`: the block before's `output_norm`, not yet
        applied to `hidden`."""
        # The block before's post-norm joins the residual in the kernel of this one's input norm,
        # and attention's post-norm in the kernel of the MLP's pre-norm: one norm kernel each.
        qkv, residual = self.attention_input(hidden, residual, x_norm=pending_norm)
        hidden = self.self_attn(qkv, batch)
        gated, residual = self.mlp_input(hidden, residual, x_norm=self.post_attention_layernorm)
        return self.mlp.down_proj(gated), residual


class Gemma3ForCausalLM(CausalLM):
    norm_offset = GEMMA_NORM_OFFSET
    scale_embeddings = True

    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_idx, rotary)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """CausalLM.forward, each block's post-feedforward norm fused into the next one's input
        norm (and the last block's into the final norm): one norm kernel a layer fewer."""
        hidden, residual, pending_norm = self.embed(batch.input_ids, batch), None, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, pending_norm)
            pending_norm = layer.output_norm
        if batch.logits_indices is not None:
            hidden, residual = hidden[batch.logits_indices], residual[batch.logits_indices]
        hidden, _ = pending_norm.then_add_and_norm(hidden, residual, self.norm)
        return hidden
