"""`decoder_stack_cpu_ref`: DecoderStackCpu's stack (decoder_stack.py) composed from the PyTorch
references of its ops, the oracle of decoder_stack_cpu.c."""

import torch

from infer.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from infer.kernels.cpu.decoder_stack import CpuBlock, CpuHead, CpuLinear, CpuStackShape
from infer.kernels.cpu.gguf_linear import gguf_linear_cpu_q8_ref
from infer.kernels.paged_attention import paged_attention_ref
from infer.kernels.rms_norm import rms_norm_ref
from infer.kernels.rope import rope_ref
from infer.kernels.store_kv import store_kv_ref


def decoder_stack_cpu_ref(
    shape: CpuStackShape,
    blocks: list[CpuBlock],
    residual: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layers,
    head: CpuHead | None = None,
) -> torch.Tensor | None:
    """DecoderStackCpu's contract from the ops' references, in place on `residual` (and the caches);
    with `head`, the rows' logits are returned."""
    rows, d = residual.shape[0], shape.head_dim
    q_width, kv_width = shape.num_q_heads * d, shape.num_kv_heads * d
    activation = silu_and_mul_ref if shape.activation == "silu" else gelu_tanh_and_mul_ref
    offset, eps = shape.norm_offset, shape.eps

    def norm(x, weight):
        return rms_norm_ref(x, weight, eps, offset=offset)

    def linear(x, layer: CpuLinear):
        if layer.gguf_format is not None:  # x rounded to int8 blocks as the kernel does
            return gguf_linear_cpu_q8_ref(x, layer.weight, layer.gguf_format, layer.bias)
        weight = layer.weight.float()
        if layer.scale is not None:
            weight = weight * layer.scale[:, None]
        return torch.nn.functional.linear(x, weight, layer.bias)

    query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
    for b, (k_cache, v_cache) in zip(blocks, kv_layers, strict=True):
        qkv = linear(norm(residual, b.input_norm), b.qkv)
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q, k = q.reshape(rows, -1, d), k.reshape(rows, -1, d)
        if b.q_norm is not None:
            q, k = norm(q, b.q_norm), norm(k, b.k_norm)
        q, k = q.contiguous(), k.contiguous()
        rope_ref(q, k, b.cos, b.sin, positions)
        store_kv_ref(k, v.reshape(rows, -1, d), k_cache, v_cache, slot_mapping)
        attended = paged_attention_ref(
            q, k_cache, v_cache, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=block_tables, num_decode_rows=rows, max_query_len=1,
            max_seq_len=int(seq_lens.max()), scale=shape.attention_scale, sliding_window=b.sliding_window,
        )  # fmt: skip
        o = linear(attended.reshape(rows, q_width), b.o)
        residual += norm(o, b.post_attention_norm) if b.sandwich else o
        x = norm(residual, b.pre_feedforward_norm if b.sandwich else b.post_attention_norm)
        down = linear(activation(linear(x, b.gate_up)), b.down)
        residual += norm(down, b.post_feedforward_norm) if b.sandwich else down
    if head is None:
        return None
    return linear(norm(residual, head.norm), head.lm_head)
