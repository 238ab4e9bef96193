"""Building blocks shared by the architectures: RMSNorm, rotary tables, GQA attention, gated MLP,
and the decoder-only language model around a stack of blocks.

Residual stream: blocks pass `(hidden, residual)` and the next norm adds the two in one fused
`add_rms_norm`, so a block's output in Hugging Face terms is `hidden + residual` (Gemma's blocks
hand on hidden before their post-feedforward norm, `output_norm`, which the next block applies
fused with its own: `output_norm(hidden) + residual`). Norms update
`residual` in place; a block called with `residual=None` takes its input as the residual and
updates that tensor. A norm in the next projection's kernel (infer.models.prenorm, batch-1 decode
on the Triton GEMV) returns a new residual instead: the block hands on whichever it got.

Which kernels run is decided when the model is built (infer.models.kernel_policy): each Linear's
method, the fused pre-norm modules, and the modules' `pdl` and `native_cpu_kernels` launch
options; `forward` never asks.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels import (
    KVStore,
    add_rms_norm,
    dequantize_gguf,
    gguf_file_format,
    gguf_file_rows,
    qk_norm_rope,
    rms_norm,
    rms_norm_add_rms_norm,
    rope,
    rope_tables,
)
from infer.models.attention import attention, kv_store
from infer.models.config import ModelConfig, RopeConfig
from infer.models.forward_batch import ForwardBatch
from infer.models.linear import Linear, empty_gguf_weight
from infer.models.linear_method import launches_pdl
from infer.models.quantization import Quantization


class Embedding(nn.Module):
    # Vocab-parallel (infer.models.tensor_parallel): this rank's rows of the table, and the ranks.
    tp_shard = None
    tp = None

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        # A GGUF block format where the table is kept in the file's blocks (Linear.gguf_format):
        # a lookup dequantizes the rows it reads, to float32.
        self.gguf_format: str | None = None
        # Where set, the dtype a lookup widens its rows to: a bf16 table under float32
        # activations on a CPU (infer.models.bf16_cpu); None: the table's own.
        self.activation_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the embeddings it returns."""
        if self.gguf_format:
            return torch.float32
        return self.activation_dtype or self.weight.dtype

    def pack_gguf(self, fmt: str) -> None:
        """Makes the table GGUF blocks of `fmt`: an empty uint8 parameter for the loader to fill."""
        num_embeddings, embedding_dim = self.weight.shape
        self.weight = empty_gguf_weight(num_embeddings, embedding_dim, fmt, self.weight.device)
        self.gguf_format = fmt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_format is not None:
            if self.tp is not None:
                raise ValueError("a GGUF embedding table is not split over tensor-parallel ranks")
            rows = gguf_file_rows(self.weight, self.gguf_format, ids.reshape(-1))
            return dequantize_gguf(rows, gguf_file_format(self.gguf_format)).view(*ids.shape, -1)
        if self.tp is None:
            rows = F.embedding(ids, self.weight)
            return rows if self.activation_dtype is None else rows.to(self.activation_dtype)
        # This rank's rows for the ids in its slice, zeros for the others: summed over ranks.
        ((start, length),) = self.tp_shard.ranges
        local = ids - start
        outside = (local < 0) | (local >= length)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class RMSNorm(nn.Module):
    """`x / rms(x) * (offset + weight)`; Gemma stores `weight` so that the scale is `1 + weight`.
    `pdl` (set by the kernel policy): one-row inputs launch with programmatic dependent launch."""

    pdl = False

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: `residual += x` in place, returns (norm, residual)."""
        pdl = launches_pdl(self.pdl, x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, offset=self.offset, pdl=pdl)
        return add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset, pdl=pdl)

    def then_add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, next_norm: "RMSNorm"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual += self(x)` in place, then `next_norm` of the new residual, in one fused op
        (a sandwich norm's output joining the residual stream); returns (normed, residual)."""
        self._check_pair(next_norm)
        weights, pdl = (self.weight, next_norm.weight), launches_pdl(next_norm.pdl, x)
        return rms_norm_add_rms_norm(x, residual, *weights, self.eps, offset=self.offset, pdl=pdl)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, *, x_norm: "RMSNorm | None" = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This norm's kernel, the residual updated in place: (`self(x + residual)`, residual);
        with `x_norm`, of `x_norm(x) + residual` (`then_add_and_norm`). The unfused half of a
        pre-norm projection (infer.models.prenorm)."""
        if x_norm is not None:
            return x_norm.then_add_and_norm(x, residual, self)
        return self(x, residual)

    def x_norm_weight(self, x_norm: "RMSNorm | None") -> torch.Tensor | None:
        """For a kernel that fuses `x_norm` before this norm: `x_norm`'s weight (None without
        one), once the pair is checked as `then_add_and_norm` checks it on the unfused path."""
        if x_norm is None:
            return None
        x_norm._check_pair(self)
        return x_norm.weight

    def _check_pair(self, next_norm: "RMSNorm") -> None:
        if (next_norm.eps, next_norm.offset) != (self.eps, self.offset):
            raise ValueError(
                f"a fused pair of norms shares eps and offset, got ({self.eps}, {self.offset}) and "
                f"({next_norm.eps}, {next_norm.offset}); call the two norms one after the other"
            )


class RotaryEmbedding:
    """cos/sin tables for one RoPE base, built on the device of first use (not module state, so
    building a model on the meta device and loading weights never has to materialise them)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # On a CPU: (the forward's positions tensor, by weak reference; its rows of the tables),
        # gathered by the first layer and reused by the others while it is the same tensor (a
        # CPU pays per op, not per byte). A ForwardBatch's positions are never written in place
        # (and inference tensors keep no version counter to tell).
        self._rows: tuple[weakref.ref, torch.Tensor, torch.Tensor] | None = None

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device:
            self._tables = rope_tables(
                self.head_dim, self.max_positions, self.rope.theta, scaling=self.rope.scaling, device=device
            )
        return self._tables

    def rotation(
        self, positions: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, index) as the rope kernels take them for `positions`: off the CPU the whole
        tables and the positions that index them; on a CPU each token's rows, gathered once per
        forward, and no index."""
        cos, sin = self.tables(device)
        if device.type != "cpu":
            return cos, sin, positions
        rows = self._rows
        if rows is None or rows[0]() is not positions:
            rows = self._rows = (weakref.ref(positions), cos[positions], sin[positions])
        return rows[1], rows[2], None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        store: KVStore | None = None,
        *,
        pdl: bool = False,
    ) -> None:
        """Rotate q and k in place; with `store` (CUDA: the rotation is the KV cache's writer
        there, infer.models.attention), then write k and `store.v` into the KV cache."""
        if q.device.type == "cpu" and store is not None:
            raise ValueError("on a CPU the KV cache is written by attention (store_kv), not the rotation")
        cos, sin, index = self.rotation(positions, q.device)
        rope(q, k, cos, sin, index, store=store, pdl=pdl)

    def normalize_and_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        positions: torch.Tensor,
        store: KVStore | None = None,
        *,
        pdl: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """QK norm (each head of q by `q_norm`, of k by `k_norm`), then the rotation, then (with
        `store`, CUDA only) k and `store.v` into the KV cache; returns the new (q, k). Off the CPU
        one fused op in place (qk_norm_rope: one kernel instead of four); on a CPU the separate
        ops, so that the rotation takes the rows gathered once per forward."""
        if q.device.type == "cpu":
            q, k = q_norm(q), k_norm(k)
            self(q, k, positions, store)
            return q, k
        cos, sin, index = self.rotation(positions, q.device)
        weights, eps, offset = (q_norm.weight, k_norm.weight), q_norm.eps, q_norm.offset
        return qk_norm_rope(q, k, *weights, eps, cos, sin, index, offset=offset, store=store, pdl=pdl)


class Attention(nn.Module):
    """Grouped-query self-attention with one fused q/k/v projection and optional per-head QK norm.
    Launch options, set by the kernel policy: `pdl` (one-row inputs launch with programmatic
    dependent launch) and `native_cpu_kernels` (a CPU's decode rows may take infer.kernels' C
    attention kernel)."""

    pdl = False
    native_cpu_kernels = True

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, *, qk_norm_offset=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_window_for_layer(layer_idx)
        if config.attn_logit_softcapping is not None:
            raise NotImplementedError(
                "attn_logit_softcapping is not supported (no Gemma 3 checkpoint sets it)"
            )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(
            config.hidden_size,
            q_size + 2 * kv_size,
            bias=config.attention_bias,
            output_sizes=tuple(self.split_sizes),
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias)
        # qk_norm_offset None: no QK norm (Llama); 0.0: Qwen 3; 1.0: Gemma 3's (1 + w).
        if qk_norm_offset is not None:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=qk_norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=qk_norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary

    def forward(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention from the q|k|v projection's output on (the block runs the projection with its
        pre-norm, infer.models.prenorm): QK norm, rotation, cache, o_proj."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        # q and k are views of the projection's output: the ops below update them in place
        # through their strides (a CPU's QK norm excepted), and attention reads them the same way.
        # Off the CPU the rotation also writes k and v into the KV cache (one kernel fewer a layer).
        store = kv_store(v, batch, self.layer_idx)
        pdl = launches_pdl(self.pdl, qkv)
        # A (t, h, w) triple per token where the batch has them (M-RoPE, infer.models.mrope).
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        if self.q_norm is not None:
            norms = (self.q_norm, self.k_norm)
            q, k = self.rotary.normalize_and_rotate(q, k, *norms, positions, store, pdl=pdl)
        else:
            self.rotary(q, k, positions, store, pdl=pdl)
        out = attention(
            q,
            k,
            v,
            batch,
            self.layer_idx,
            scale=self.scale,
            sliding_window=self.sliding_window,
            kv_stored=store is not None,
            native_cpu_kernels=self.native_cpu_kernels,
            pdl=pdl,
        )
        return self.o_proj(out.reshape(num_tokens, -1))


# A config's hidden activation by its name in infer.kernels (gated_gemv, silu_and_mul...).
_GATED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up fused into one `[2 * intermediate, hidden]` matmul.
    In a block, `gate_up_proj` runs with its pre-norm (infer.models.prenorm), then `down_proj`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.hidden_activation not in _GATED_ACTIVATIONS:
            raise ValueError(
                f"hidden activation {config.hidden_activation!r} is not supported; "
                f"supported: {', '.join(_GATED_ACTIVATIONS)}"
            )
        self.activation_name = _GATED_ACTIVATIONS[config.hidden_activation]
        self.gate_up_proj = Linear(
            config.hidden_size,
            2 * config.intermediate_size,
            output_sizes=(config.intermediate_size, config.intermediate_size),
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated(x, self.activation_name))


def rotary_per_layer(
    config: ModelConfig, rotary_class: type[RotaryEmbedding] = RotaryEmbedding
) -> list[RotaryEmbedding]:
    """One RotaryEmbedding per layer, shared between layers with the same RoPE settings."""
    shared: dict[tuple, RotaryEmbedding] = {}
    rotaries = []
    for layer_idx in range(config.num_layers):
        rope_config = config.rope_for_layer(layer_idx)
        key = (rope_config.theta, repr(rope_config.scaling))
        if key not in shared:
            shared[key] = rotary_class(config.head_dim, config.max_position_embeddings, rope_config)
        rotaries.append(shared[key])
    return rotaries


class CausalLM(nn.Module):
    """Embedding, a stack of decoder blocks, the final norm and the LM head.

    Subclasses set `make_layer` (block constructor), `norm_offset` (1.0 for Gemma's 1 + w) and
    `scale_embeddings` (Gemma multiplies embeddings by sqrt(hidden_size)).
    """

    norm_offset = 0.0
    scale_embeddings = False
    # Tensor parallelism: the ranks this model is a shard of (infer.models.tensor_parallel).
    tp = None
    # The rotary tables' class (infer.models.mrope.MRotaryEmbedding for Qwen3-VL).
    rotary_class = RotaryEmbedding

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # How the Linear weights are stored (set by the loader); None: dense, in the model's dtype.
        self.quantization: Quantization | None = None
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotaries = rotary_per_layer(config, self.rotary_class)
        self.layers = nn.ModuleList(self.make_layer(config, i, rotaries[i]) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=self.norm_offset)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A vision-language checkpoint's tower (infer.models.vision.VisionTower), set by the
        # loader. An instance attribute: a class attribute would hide the submodule.
        self.vision: nn.Module | None = None

    def make_layer(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer in this model's cache: the config's, or a tensor-parallel rank's."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache: the embedding's (never 8-bit)."""
        return self.embed_tokens.dtype

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """Token embeddings; with `batch.image_embeds`, those image embeddings at their tokens."""
        images = batch is not None and batch.image_embeds is not None
        if images:  # an image token's id may lie past the table (Gemma 3's does): looked up as 0
            input_ids = input_ids.index_fill(0, batch.image_token_indices, 0)
        hidden = self.embed_tokens(input_ids)
        if self.scale_embeddings:
            # As Hugging Face does: the scale is rounded to the model dtype before multiplying.
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        if images:
            hidden = hidden.index_copy(0, batch.image_token_indices, batch.image_embeds.to(hidden.dtype))
        return hidden

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm, `[num_tokens, hidden_size]`, or only the rows of
        `batch.logits_indices` when it is set (the final norm then runs on those alone)."""
        hidden, residual = self.embed(batch.input_ids, batch), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        if batch.logits_indices is not None:
            hidden, residual = hidden[batch.logits_indices], residual[batch.logits_indices]
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits `[..., vocab_size]`, soft-capped where the config says so; written into
        `out` where given (a CUDA graph's output buffer, which every graph shares)."""
        logits = self.lm_head(hidden)
        if self.tp is not None:  # each rank's vocab slice, the last one padded
            logits = self.tp.all_gather_last(logits)[..., : self.config.vocab_size]
        logits = logits.float() if out is None else out.copy_(logits)
        return self.soft_cap(logits)

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` soft-capped in place where the config says so (Gemma 3); returns them."""
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits
