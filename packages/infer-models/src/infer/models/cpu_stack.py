"""A CPU decode backend: a CausalLM's blocks as infer.kernels' DecoderStackCpu takes them. On a
CPU, a step whose rows are all decode tokens (up to its MAX_ROWS) runs every block in one C call
instead of ~80 ops and Python calls a block (docs/architecture.md, "A CPU decode step's blocks in
one C call").

`CpuDecodeStack.for_model(model)` builds it from the model's loaded weights (float32, bf16 under
float32 activations (infer.models.bf16_cpu), int8 per channel, or GGUF Q4_0 / Q4_1 / Q8_0
blocks), or says why the model does not fit (other 8-bit weights, norms that do not share one eps
and offset, activations other than float32, a block of another shape, a library that does not
build here); the engine's runner builds it where its kernel policy allows the C kernels, and
selects it per step (`takes(batch)`) as it selects a CUDA graph. The C stack is the KV cache's
writer on the steps it runs. Where the model's final norm and LM head fit the C stack too
(`CpuHead`), `logits(batch)` ends the step's C call with the logits, so that no torch op follows the
stack's stream of weights through cold caches. The PyTorch path stays the oracle: infer-engine's
tests/test_cpu_stack.py holds the two to the same tokens and logprobs.
"""

import logging

import torch

from infer.kernels import (
    CpuBlock,
    CpuHead,
    CpuLinear,
    CpuStackShape,
    DecoderStackCpu,
    int8_cpu_scale,
    int8_linear_cpu_supports,
)
from infer.kernels.cpu.decoder_stack import MAX_ROWS
from infer.models.forward_batch import ForwardBatch
from infer.models.linear import Linear

logger = logging.getLogger(__name__)


class CpuDecodeStack:
    """`model`'s forward for a CPU step of decode rows: the embedding, the C stack, the final norm;
    and its logits, the final norm and the LM head in the stack's call where they fit it."""

    def __init__(self, model, stack: DecoderStackCpu):
        self.model = model
        self.stack = stack
        self.num_steps = 0  # steps run so far

    @classmethod
    def for_model(cls, model) -> "CpuDecodeStack | None":
        """The backend over `model`'s blocks (a CausalLM on the CPU, weights loaded), or None
        where it does not fit, the reason logged at INFO."""
        try:
            if not DecoderStackCpu.runs_here():
                raise ValueError("decoder_stack_cpu.c does not build here")
            shape, blocks = _shape(model), [_block(layer) for layer in model.layers]
            stack = DecoderStackCpu(shape, blocks)
        except ValueError as why:
            logger.info("infer.models: decode steps take the PyTorch path on this CPU: %s", why)
            return None
        try:
            stack.attach_head(CpuHead(model.norm.weight.data, _linear(model.lm_head)))
        except ValueError as why:
            logger.info("infer.models: the LM head runs after the C stack, not in its call: %s", why)
        return cls(model, stack)

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether a step goes to the C stack: with a cache, every row one decode token, at most
        MAX_ROWS rows, no image embedding (a one-token chunk may be an image's last token)."""
        metadata = batch.attention
        return (
            batch.kv_layers is not None
            and batch.image_embeds is None
            and metadata is not None
            and metadata.num_decode_rows == batch.num_tokens <= MAX_ROWS
        )

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """What `model(batch)` returns: the final norm of the stream after the last block (of
        the rows of `batch.logits_indices` when it is set)."""
        stream = self._run(batch)
        if batch.logits_indices is not None:
            stream = stream[batch.logits_indices]
        return self.model.norm(stream)

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """What `model.compute_logits(model(batch))` returns: from one C call where the stack holds
        the final norm and the LM head."""
        head = self.stack.head
        if head is None:
            return self.model.compute_logits(self(batch))
        logits = torch.empty(batch.input_ids.shape[0], head.lm_head.shape[0], dtype=torch.float32)
        self._run(batch, logits)
        if batch.logits_indices is not None:
            logits = logits[batch.logits_indices]
        return self.model.soft_cap(logits)

    def _run(self, batch: ForwardBatch, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The embedded tokens through the C stack (into `logits` too, where given): the stream."""
        metadata = batch.attention
        self.num_steps += 1
        stream = self.model.embed(batch.input_ids)
        self.stack(
            stream,
            batch.positions,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            batch.kv_layers,
            logits=logits,
        )
        return stream


def _shape(model) -> CpuStackShape:
    first = model.layers[0]
    activation = first.mlp.activation_name
    attention = first.self_attn
    norms = [module for module in model.modules() if hasattr(module, "eps") and hasattr(module, "offset")]
    if len({(norm.eps, norm.offset) for norm in norms}) != 1:
        raise ValueError("its norms do not share one eps and offset")
    if model.dtype != torch.float32:
        raise ValueError(f"its activations are {model.dtype}, not float32")
    return CpuStackShape(
        num_q_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        eps=norms[0].eps,
        norm_offset=norms[0].offset,
        attention_scale=attention.scale,
        activation=activation,
    )


def _block(layer) -> CpuBlock:
    attention, mlp = layer.self_attn, layer.mlp
    cos, sin = attention.rotary.tables(torch.device("cpu"))
    pre_feedforward = getattr(layer, "pre_feedforward_layernorm", None)
    post_feedforward = getattr(layer, "post_feedforward_layernorm", None)
    return CpuBlock(
        input_norm=layer.input_layernorm.weight.data,
        qkv=_linear(attention.qkv_proj),
        o=_linear(attention.o_proj),
        post_attention_norm=layer.post_attention_layernorm.weight.data,
        gate_up=_linear(mlp.gate_up_proj),
        down=_linear(mlp.down_proj),
        cos=cos,
        sin=sin,
        pre_feedforward_norm=None if pre_feedforward is None else pre_feedforward.weight.data,
        post_feedforward_norm=None if post_feedforward is None else post_feedforward.weight.data,
        q_norm=None if attention.q_norm is None else attention.q_norm.weight.data,
        k_norm=None if attention.k_norm is None else attention.k_norm.weight.data,
        sliding_window=attention.sliding_window,
    )


def _linear(linear: Linear) -> CpuLinear:
    bias = None if linear.bias is None else linear.bias.data
    if linear.gguf_format is not None:
        return CpuLinear(linear.weight.data, None, bias, gguf_format=linear.gguf_format)
    if linear.weight_scale is None:
        return CpuLinear(linear.weight.data, None, bias)
    if linear.block_size != (1, linear.in_features) or not int8_linear_cpu_supports(linear.weight):
        raise ValueError(f"a Linear's 8-bit weight ({linear.extra_repr()}) is not int8 per channel")
    return CpuLinear(linear.weight.data, int8_cpu_scale(linear.weight_scale.data).float32, bias)
