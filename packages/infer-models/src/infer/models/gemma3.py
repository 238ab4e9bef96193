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
        # The block hands on the MLP's output before this norm: the next block (or the final
        # norm) applies it in the same kernel as the residual add and its own norm.
        self.output_norm = self.post_feedforward_layernorm

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
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
            qkv = self.self_attn.qkv_proj(hidden)
        else:
            # The block before's post-norm, the add and this block's input norm: one kernel, and
            # at batch-1 decode on the Triton GEMV the q|k|v projection's too.
            qkv, residual = self.input_layernorm.project(
                hidden, residual, self.self_attn.qkv_proj, x_norm=pending_norm
            )
        hidden = self.self_attn.attend(qkv, batch)
        # Attention's post-norm, the add and the MLP's pre-norm: one kernel, not two (and at
        # batch-1 decode on the Triton GEMV, where its grid is one wave, the gate/up projection's).
        return self.mlp.after_norm(
            self.pre_feedforward_layernorm, hidden, residual, x_norm=self.post_attention_layernorm
        )


class Gemma3ForCausalLM(CausalLM):
    norm_offset = GEMMA_NORM_OFFSET
    scale_embeddings = True

    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_idx, rotary)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """CausalLM.forward, each block's post-feedforward norm fused into the next one's input
        norm (and the last block's into the final norm): one norm kernel a layer fewer."""
        hidden, residual, pending_norm = self.embed(batch.input_ids), None, None
        if self.runs_cpu_stack(batch, hidden):
            return self.forward_cpu_stack(batch, hidden)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, pending_norm)
            pending_norm = layer.output_norm
        if batch.logits_indices is not None:
            hidden, residual = hidden[batch.logits_indices], residual[batch.logits_indices]
        hidden, _ = pending_norm.then_add_and_norm(hidden, residual, self.norm)
        return hidden
