"""Tensor parallelism (Megatron-LM's layout, as vLLM's): each of `size` ranks holds a slice of
every large weight and the ranks sum or gather their partial results with torch.distributed
(NCCL on CUDA, gloo on a CPU).

- Attention: the q|k|v projection is column-parallel by heads (each rank its KV heads and the
  query heads of their groups; where a model has fewer KV heads than ranks, each KV head is
  replicated on the ranks that split its query group), o_proj row-parallel.
- MLP: gate|up column-parallel (each rank a slice of the intermediate size), down row-parallel.
- A row-parallel Linear's output is a partial sum: `Linear.forward` all-reduces it.
- Embedding and LM head are vocab-parallel: each rank a contiguous slice of ceil(V / size)
  rows (the last one padded with zero rows); a token's embedding is the sum over ranks (the
  others contribute zeros), the logits the concatenation of the ranks' slices.
- Norms, rotary tables and everything else are replicated.
- 8-bit Linears with one scale per output row (int8) shard as dense ones: a column-parallel
  shard holds its rows' scales; a row-parallel one every scale, since each covers a whole row
  and so the rank's columns too (quantized as it loads, a row-parallel shard's scales are its
  columns' own: each rank's partial sum is still exact for its weights).

`shard_model` turns a model built on the meta device into its rank's shard before the loader
fills it; each sharded module's `tp_shard` tells the loader which part of each checkpoint tensor
to read (infer.models.loader.weights). Slices need not be even (SmolLM2's 9 heads over 2 ranks:
its 3 KV heads give one rank 2 groups and the other 1), but a KV head's query group splits only
evenly.
"""

import math
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks that share a model."""

    rank: int
    size: int
    group: "dist.ProcessGroup | None" = None  # None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` (equal shapes) concatenated along the last dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class ShardSpec:
    """Which part of each checkpoint tensor a sharded parameter holds: along `dim` (0: rows, for
    column-parallel and vocab-parallel weights; 1: columns, for row-parallel ones), per
    checkpoint tensor fused into it, `(start, length)` of its `full_sizes` entry; then
    `padding` zero rows (a vocab slice shorter than the others)."""

    dim: int
    full_sizes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    padding: int = 0

    def take(self, part_index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor number `part_index` (a 1-D bias: along dim 0)."""
        start, length = self.ranges[part_index]
        return tensor.narrow(min(self.dim, tensor.dim() - 1), start, length)


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now: where ranks on this host meet, or a local server listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def even_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """`(start, length)` of rank's share of `total` items split as evenly as they go."""
    start, end = total * rank // size, total * (rank + 1) // size
    return start, end - start


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Makes `model` (a CausalLM built on the meta device, not loaded) rank `tp.rank`'s shard."""
    from infer.models.common import Attention, Embedding, GatedMLP

    if tp.size == 1:
        return
    if model.quantization is not None and model.quantization.is_int4:
        raise ValueError(
            f"tensor parallelism does not shard 4-bit weights ({model.quantization.method}) yet: serve "
            "the dense checkpoint, or use one GPU"
        )
    if model.quantization is not None and model.quantization.block_size is not None:
        raise ValueError(
            f"tensor parallelism shards 8-bit weights with one scale per output row (int8); "
            f"{model.quantization.method} scales per {model.quantization.block_size} block do not "
            "shard yet: serve the dense checkpoint, or use one GPU"
        )
    vocab_size = model.config.vocab_size
    vocab_rows = math.ceil(vocab_size / tp.size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, tp)
        elif isinstance(module, GatedMLP):
            _shard_mlp(module, tp)
        elif isinstance(module, Embedding):
            _shard_vocab(module, vocab_size, vocab_rows, tp)
            module.tp = tp  # its lookup sums over the ranks (the head's logits: CausalLM.tp)
    _shard_vocab(model.lm_head, vocab_size, vocab_rows, tp)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.tp = tp


def _shard_attention(attention: nn.Module, tp: TensorParallel) -> None:
    num_heads, num_kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_start, kv_count = even_range(num_kv_heads, tp.rank, tp.size)
        q_start, q_count = kv_start * group, kv_count * group
    else:
        if tp.size % num_kv_heads or group % (tp.size // num_kv_heads):
            raise ValueError(
                f"{num_heads} query heads in {num_kv_heads} KV heads do not split over "
                f"{tp.size} ranks: with fewer KV heads than ranks, each KV head's query group "
                "splits evenly over its ranks"
            )
        sharing = tp.size // num_kv_heads  # ranks that hold each KV head
        kv_start, kv_count = tp.rank // sharing, 1
        q_count = group // sharing
        q_start = kv_start * group + (tp.rank % sharing) * q_count
    q_size, kv_size = q_count * head_dim, kv_count * head_dim
    q_range, kv_range = (q_start * head_dim, q_size), (kv_start * head_dim, kv_size)
    qkv = attention.qkv_proj
    qkv_spec = ShardSpec(dim=0, full_sizes=qkv.output_sizes, ranges=(q_range, kv_range, kv_range))
    _shard_columns_out(qkv, (q_size, kv_size, kv_size), qkv_spec)
    attention.num_heads, attention.num_kv_heads = q_count, kv_count
    attention.split_sizes = [q_size, kv_size, kv_size]
    o_spec = ShardSpec(dim=1, full_sizes=(num_heads * head_dim,), ranges=(q_range,))
    _shard_rows_in(attention.o_proj, o_spec, tp)


def _shard_mlp(mlp: nn.Module, tp: TensorParallel) -> None:
    gate_up = mlp.gate_up_proj
    intermediate = gate_up.output_sizes[0]
    start, length = even_range(intermediate, tp.rank, tp.size)
    _shard_columns_out(
        gate_up,
        (length, length),
        ShardSpec(dim=0, full_sizes=gate_up.output_sizes, ranges=((start, length), (start, length))),
    )
    _shard_rows_in(mlp.down_proj, ShardSpec(dim=1, full_sizes=(intermediate,), ranges=((start, length),)), tp)


def _shard_columns_out(linear: nn.Module, output_sizes: tuple[int, ...], spec: ShardSpec) -> None:
    """A column-parallel Linear: its output rows cut to `output_sizes` (one per fused part)."""
    out_features = sum(output_sizes)
    linear.out_features, linear.output_sizes = out_features, output_sizes
    linear.weight = _empty_like(linear.weight, (out_features, linear.in_features))
    if linear.block_size is not None:  # one scale per row: the shard's rows'
        linear.weight_scale = _empty_like(linear.weight_scale, (out_features, 1))
    if linear.bias is not None:
        linear.bias = _empty_like(linear.bias, (out_features,))
    linear.tp_shard = spec


def _shard_rows_in(linear: nn.Module, spec: ShardSpec, tp: TensorParallel) -> None:
    """A row-parallel Linear: its input columns cut to the rank's range; `forward` all-reduces."""
    if linear.bias is not None:
        raise ValueError(
            "a row-parallel Linear with a bias is not supported (no Llama, Qwen 3 or Gemma 3 has one)"
        )
    ((_, length),) = spec.ranges
    linear.in_features = length
    linear.weight = _empty_like(linear.weight, (linear.out_features, length))
    # An 8-bit one keeps every row's scale, and its block of one whole row spans its columns.
    linear.tp_shard = spec
    linear.tp_reduce = tp


def _shard_vocab(module: nn.Module, vocab_size: int, vocab_rows: int, tp: TensorParallel) -> None:
    """A vocab-parallel embedding table or LM head: rows [rank * vocab_rows, ...) of the
    vocabulary, padded to vocab_rows."""
    start = min(vocab_size, tp.rank * vocab_rows)
    length = min(vocab_size, start + vocab_rows) - start
    module.weight = _empty_like(module.weight, (vocab_rows, module.weight.shape[1]))
    if hasattr(module, "out_features"):  # the LM head, a Linear
        module.out_features, module.output_sizes = vocab_rows, (vocab_rows,)
        if module.block_size is not None:  # 8-bit: its rows' scales (padding rows: scale 1)
            module.weight_scale = _empty_like(module.weight_scale, (vocab_rows, 1))
    module.tp_shard = ShardSpec(
        dim=0, full_sizes=(vocab_size,), ranges=((start, length),), padding=vocab_rows - length
    )


def _empty_like(param: nn.Parameter, shape: tuple[int, ...]) -> nn.Parameter:
    """A new uninitialised parameter of `shape` with `param`'s dtype and device (the meta device,
    before loading)."""
    return nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), requires_grad=False)
