"""A decoder-only model's stack of blocks for a CPU step of decode rows, in one C call.

A CPU pays per op, not per byte. Through the PyTorch path SmolLM2's decode step makes about 80 ops
and as many Python calls a block, 30 blocks a token, which on the CI-class VM took 8 ms of an int8
token's 20 (docs/benchmarks/generation.md#cpu-smollm2-135m-instruct). `DecoderStackCpu` runs every
block of a step of up to MAX_ROWS decode rows in `decoder_stack_cpu.c` (infer.kernels.cpu.native),
which includes the int8 product of int8_gemv_cpu.c and the attention of decode_attention_cpu.c; the
embedding stays with the caller, and so do the final norm and the LM head unless the stack is given
them (`CpuHead`), when a call may end with the logits.

The blocks are pre-norm (Llama, Qwen 3) or sandwich-norm (Gemma 3: `pre_feedforward_norm` and
`post_feedforward_norm` set), with optional per-head QK norms, every norm scaling by
`norm_offset + weight`, a gated MLP (silu or gelu_tanh), neox rotary tables per block and an
optional sliding window. Linears are float32, bf16 (bf16_linear_cpu's kernel, which widens the
weight to fp32 in registers), int8 with one float32 scale per output channel (int8_linear_cpu's
kernel, which rounds each row of x to int16), or a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks
(gguf_linear_cpu's kernel, which rounds x to int8 blocks of 32). `decoder_stack_cpu_ref`
(decoder_stack_reference.py) is the same stack in plain PyTorch from the ops' references: the
oracle.

`DecoderStackCpu(shape, blocks, head)` raises ValueError, naming the tensor, for what the C path
does not take; it keeps the tensors it was given alive, and reads them at every call (weights loaded
in place are seen, tensors replaced are not).
"""

import ctypes
from dataclasses import dataclass
from typing import NamedTuple

import torch

from infer.kernels.cpu.gguf_linear import BLOCK as GGUF_BLOCK
from infer.kernels.cpu.gguf_linear import GGUF_FORMATS, gguf_linear_cpu_supports
from infer.kernels.cpu.int8_linear import ALIGNMENT, K_MULTIPLE
from infer.kernels.cpu.native import POINTER, SIZE, load_native, native_function
from infer.kernels.paged_attention import NATIVE_MAX_HEAD_DIM

SOURCE = "decoder_stack_cpu.c"
# Decode rows a call takes: each row re-reads a block of weight rows from L1, which pays up to a few
# rows; past them, the batched products of the PyTorch path win (as int8_linear_cpu's AVX2_MAX_ROWS).
MAX_ROWS = 8
ACTIVATIONS = ("silu", "gelu_tanh")


class CpuLinear(NamedTuple):
    """`x @ (weight * scale[:, None]).T + bias`: weight [n, k] float32 or bf16 (scale None) or int8; or,
    with `gguf_format`, `x @ dequantize_gguf(weight, gguf_format).T + bias` for a weight of GGUF
    blocks, uint8 [n, k / 32 * block bytes] (gguf_linear_cpu's kernel)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None  # [n] float32, one per output channel
    bias: torch.Tensor | None = None  # [n] float32
    gguf_format: str | None = None  # a key of GGUF_FORMATS

    @property
    def shape(self) -> tuple[int, int]:
        """[n, k] of the weight it stands for."""
        n, width = self.weight.shape
        if self.gguf_format is None:
            return n, width
        return n, width // GGUF_FORMATS[self.gguf_format].block_bytes * GGUF_BLOCK


@dataclass(frozen=True)
class CpuStackShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    norm_offset: float  # every norm scales by norm_offset + weight (Gemma 3: 1)
    attention_scale: float
    activation: str  # "silu" or "gelu_tanh"


@dataclass(frozen=True)
class CpuBlock:
    """One block's tensors (float32 but for bf16 and int8 weights). q|k|v and gate|up are fused Linears."""

    input_norm: torch.Tensor
    qkv: CpuLinear
    o: CpuLinear
    post_attention_norm: torch.Tensor
    gate_up: CpuLinear
    down: CpuLinear
    cos: torch.Tensor  # [max_positions, head_dim // 2]
    sin: torch.Tensor
    pre_feedforward_norm: torch.Tensor | None = None  # with post_feedforward_norm: a sandwich block
    post_feedforward_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # with k_norm: per-head QK norms of head_dim
    k_norm: torch.Tensor | None = None
    sliding_window: int | None = None

    @property
    def sandwich(self) -> bool:
        return self.pre_feedforward_norm is not None


@dataclass(frozen=True)
class CpuHead:
    """What follows the blocks: the final norm (float32 [hidden], scaling by the stack's
    norm_offset + weight) and the LM head ([vocab, hidden]), logits = lm_head(norm(stream))."""

    norm: torch.Tensor
    lm_head: CpuLinear


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("gguf_type", ctypes.c_int64),
        ("bf16", ctypes.c_int64),
    ]


class _Block(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("input_norm", "post_attention_norm", "pre_feedforward_norm",
                                               "post_feedforward_norm", "q_norm", "k_norm")),
        *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("sliding_window", ctypes.c_int64),
    ]  # fmt: skip


class _Stack(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("num_blocks", "hidden_size", "num_q_heads", "num_kv_heads",
                                              "head_dim", "intermediate_size", "block_size")),
        ("eps", ctypes.c_float),
        ("norm_offset", ctypes.c_float),
        ("attention_scale", ctypes.c_float),
        ("activation", ctypes.c_int),
    ]  # fmt: skip


# decoder_stack_cpu.c's entry points: (stack, blocks, residual, rows, positions, slot mapping,
# block tables, their row stride, lengths, threads) -> status; and with the head and the logits:
# (stack, blocks, head, final norm, residual, ..., lengths, logits, threads) -> status.
_DECODER_STACK_ARGS = (ctypes.POINTER(_Stack), ctypes.POINTER(_Block), POINTER, SIZE, POINTER, POINTER,
                       POINTER, SIZE, POINTER, ctypes.c_int)  # fmt: skip
_DECODER_STACK_LOGITS_ARGS = (ctypes.POINTER(_Stack), ctypes.POINTER(_Block), ctypes.POINTER(_Linear),
                              POINTER, POINTER, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER, POINTER,
                              ctypes.c_int)  # fmt: skip


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecoderStackCpu:
    """The C stack for one model's blocks; `runs_here()` says whether it can be called now."""

    def __init__(self, shape: CpuStackShape, blocks: list[CpuBlock], head: CpuHead | None = None):
        if not blocks:
            raise ValueError("a decoder stack needs at least one block")
        self.shape, self.blocks = shape, blocks
        self.hidden_size = blocks[0].input_norm.shape[0]
        self.intermediate_size = blocks[0].down.shape[1]
        self.max_positions = min(min(b.cos.shape[0], b.sin.shape[0]) for b in blocks)
        _check_shape(shape, self.hidden_size)
        for index, block in enumerate(blocks):
            _check_block(index, block, shape, self.hidden_size, self.intermediate_size)
        self.head = None
        if head is not None:
            self.attach_head(head)
        self._blocks = (_Block * len(blocks))(*(self._block(b) for b in blocks))
        self._stack = _Stack(
            num_blocks=len(blocks),
            hidden_size=self.hidden_size,
            num_q_heads=shape.num_q_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            intermediate_size=self.intermediate_size,
            eps=shape.eps,
            norm_offset=shape.norm_offset,
            attention_scale=shape.attention_scale,
            activation=ACTIVATIONS.index(shape.activation),
        )
        self._cache_pointers: tuple = ()

    def attach_head(self, head: CpuHead) -> None:
        """End each call with `head`'s logits; a ValueError, and the stack as it was, where the
        head is not one the C code takes."""
        vocab = head.lm_head.shape[0]
        _check_vector(head.norm, self.hidden_size, lambda why: _refuse("the head's norm", why))
        _check_linear(head.lm_head, vocab, self.hidden_size, lambda why: _refuse("the LM head", why))
        self.head, self._head = head, _c_linear(head.lm_head)

    @staticmethod
    def runs_here() -> bool:
        """Whether the C library builds here (infer.kernels.cpu.native)."""
        return load_native(SOURCE) is not None

    def __call__(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_layers,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Every block over `residual` [rows, hidden] float32, in place: in, the embedded tokens;
        out, the stream after the last block. Row r is a decode token at `positions[r]` (int64)
        stored at `slot_mapping[r]` (int64) that attends to its `seq_lens[r]` keys (int32) through
        `block_tables[r]` (int32); `kv_layers` is each block's (k_cache, v_cache). With `logits`
        (float32 [rows, vocab], a stack given a head), each row's logits are written there too."""
        rows = residual.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"DecoderStackCpu takes 1 to {MAX_ROWS} decode rows, got {rows}")
        if (
            residual.dtype != torch.float32
            or not residual.is_contiguous()
            or residual.shape[1] != self.hidden_size
        ):
            raise ValueError(
                f"residual must be contiguous float32 [rows, {self.hidden_size}], got {residual.dtype} "
                f"{list(residual.shape)}"
            )
        indices = (("positions", positions, torch.int64), ("slot_mapping", slot_mapping, torch.int64),
                   ("seq_lens", seq_lens, torch.int32))  # fmt: skip
        for name, t, dtype in indices:
            if t.dtype != dtype or t.shape != (rows,) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous {dtype} [{rows}], got {t.dtype} {list(t.shape)}")
        if block_tables.dtype != torch.int32 or block_tables.shape[0] != rows or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables must be int32 [{rows}, blocks] with unit column stride")
        if int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"positions reach {int(positions.max())}, past the rotary tables' {self.max_positions}"
            )
        num_slots = self._caches(kv_layers)
        if int(slot_mapping.max()) >= num_slots or int(slot_mapping.min()) < 0:
            raise ValueError(f"slot_mapping holds a slot outside the cache's {num_slots}")
        step = (residual.data_ptr(), rows, positions.data_ptr(), slot_mapping.data_ptr(),
                block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr())  # fmt: skip
        if logits is None:
            run = native_function(SOURCE, "decoder_stack", _DECODER_STACK_ARGS)
        else:
            if self.head is None:
                raise ValueError("logits need a stack given a head (CpuHead)")
            vocab = self.head.lm_head.shape[0]
            if logits.dtype != torch.float32 or logits.shape != (rows, vocab) or not logits.is_contiguous():
                got = f"{logits.dtype} {list(logits.shape)}"
                raise ValueError(f"logits must be contiguous float32 [{rows}, {vocab}], got {got}")
            run = native_function(SOURCE, "decoder_stack_logits", _DECODER_STACK_LOGITS_ARGS)
        if run is None:
            raise RuntimeError("decoder_stack_cpu.c does not build here (DecoderStackCpu.runs_here())")
        if logits is None:
            status = run(ctypes.byref(self._stack), self._blocks, *step, torch.get_num_threads())
        else:
            head = (ctypes.byref(self._head), self.head.norm.data_ptr())
            status = run(ctypes.byref(self._stack), self._blocks, *head, *step, logits.data_ptr(),
                         torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise MemoryError("decoder_stack_cpu could not allocate its buffers")

    def _caches(self, kv_layers) -> int:
        """Points each block at its (k_cache, v_cache), checked when they change; their slots.
        Keyed by address and shape: another engine's caches may be allocated where an earlier
        one's were freed, in blocks of another size."""
        pointers = tuple((t.data_ptr(), t.shape) for pair in kv_layers for t in pair)
        if pointers != self._cache_pointers:
            if len(kv_layers) != len(self.blocks):
                raise ValueError(f"kv_layers has {len(kv_layers)} layers for {len(self.blocks)} blocks")
            k0 = kv_layers[0][0]
            shape = self.shape
            expected = (k0.shape[0], k0.shape[1], shape.num_kv_heads, shape.head_dim)
            for index, (k_cache, v_cache) in enumerate(kv_layers):
                for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                    if (
                        cache.dtype != torch.float32
                        or tuple(cache.shape) != expected
                        or not cache.is_contiguous()
                    ):
                        raise ValueError(
                            f"layer {index}'s {name} must be contiguous float32 {list(expected)}, "
                            f"got {cache.dtype} {list(cache.shape)}"
                        )
                self._blocks[index].k_cache = k_cache.data_ptr()
                self._blocks[index].v_cache = v_cache.data_ptr()
            self._stack.block_size = expected[1]
            self._cache_pointers = pointers
            self._num_slots = expected[0] * expected[1]
        return self._num_slots

    def _block(self, b: CpuBlock) -> _Block:
        linear = _c_linear
        return _Block(
            input_norm=b.input_norm.data_ptr(),
            post_attention_norm=b.post_attention_norm.data_ptr(),
            pre_feedforward_norm=_pointer(b.pre_feedforward_norm),
            post_feedforward_norm=_pointer(b.post_feedforward_norm),
            q_norm=_pointer(b.q_norm),
            k_norm=_pointer(b.k_norm),
            qkv=linear(b.qkv),
            o=linear(b.o),
            gate_up=linear(b.gate_up),
            down=linear(b.down),
            cos=b.cos.data_ptr(),
            sin=b.sin.data_ptr(),
            sliding_window=b.sliding_window or 0,
        )


def _c_linear(layer: CpuLinear) -> _Linear:
    n, k = layer.shape
    gguf_type = 0 if layer.gguf_format is None else GGUF_FORMATS[layer.gguf_format].type_id
    bf16 = int(layer.weight.dtype == torch.bfloat16)
    return _Linear(
        layer.weight.data_ptr(), _pointer(layer.scale), _pointer(layer.bias), n, k, gguf_type, bf16
    )


def _refuse(name: str, why: str):
    raise ValueError(f"{name}: {why}")


def _check_vector(t: torch.Tensor, size: int, fail) -> None:
    """A norm's weight, a scale or a bias: contiguous float32 [size]; else `fail(why)`."""
    if t.dtype != torch.float32 or tuple(t.shape) != (size,) or not t.is_contiguous():
        fail(f"must be contiguous float32 [{size}], got {t.dtype} {list(t.shape)}")


def _check_linear(linear: CpuLinear, n: int, k: int, fail) -> None:
    """A Linear of [n, k] in a format the C stack takes; else `fail(why)`."""
    w = linear.weight
    if linear.gguf_format is not None:
        if (
            linear.scale is not None
            or not gguf_linear_cpu_supports(w, linear.gguf_format, k)
            or w.shape[0] != n
        ):
            fail(f"a {linear.gguf_format} weight must be contiguous uint8 blocks of [{n}, {k}]")
    elif tuple(w.shape) != (n, k) or not w.is_contiguous():
        fail(f"weight must be contiguous [{n}, {k}], got {list(w.shape)}")
    elif linear.scale is None:
        if w.dtype not in (torch.float32, torch.bfloat16) or k % 8:
            fail(f"a float32 or bf16 weight (no scale) needs K % 8 == 0, got {w.dtype}, K = {k}")
    elif w.dtype != torch.int8 or k % K_MULTIPLE or w.data_ptr() % ALIGNMENT:
        fail(f"an int8 weight needs K % {K_MULTIPLE} == 0 and {ALIGNMENT}-byte alignment")
    for part, vector in (("scale", linear.scale), ("bias", linear.bias)):
        if vector is not None:
            _check_vector(vector, n, lambda why, part=part: fail(f"its {part} {why}"))


def _check_shape(shape: CpuStackShape, hidden_size: int) -> None:
    if shape.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {shape.activation!r}")
    d = shape.head_dim
    if d % 8 or d > NATIVE_MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 8 and at most {NATIVE_MAX_HEAD_DIM}, got {d}")
    if shape.num_kv_heads < 1 or shape.num_q_heads % shape.num_kv_heads:
        raise ValueError(f"{shape.num_q_heads} query heads do not group over {shape.num_kv_heads} KV heads")
    if hidden_size % 8:
        raise ValueError(f"hidden_size must be a multiple of 8, got {hidden_size}")


def _check_block(index: int, b: CpuBlock, shape: CpuStackShape, hidden: int, intermediate: int) -> None:
    def fail(name: str, why: str):
        raise ValueError(f"block {index}'s {name}: {why}")

    def vector(name: str, t: torch.Tensor | None, size: int, optional: bool = False) -> None:
        if t is None:
            if not optional:
                fail(name, "missing")
            return
        _check_vector(t, size, lambda why: fail(name, why))

    q_width, kv_width = shape.num_q_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    linears = {
        "qkv": (b.qkv, q_width + 2 * kv_width, hidden),
        "o": (b.o, hidden, q_width),
        "gate_up": (b.gate_up, 2 * intermediate, hidden),
        "down": (b.down, hidden, intermediate),
    }
    for name, (linear, n, k) in linears.items():
        _check_linear(linear, n, k, lambda why, name=name: fail(name, why))
    for name in ("input_norm", "post_attention_norm"):
        vector(name, getattr(b, name), hidden)
    if (b.pre_feedforward_norm is None) != (b.post_feedforward_norm is None):
        fail("feedforward norms", "a sandwich block sets both pre_feedforward_norm and post_feedforward_norm")
    vector("pre_feedforward_norm", b.pre_feedforward_norm, hidden, optional=True)
    vector("post_feedforward_norm", b.post_feedforward_norm, hidden, optional=True)
    if (b.q_norm is None) != (b.k_norm is None):
        fail("QK norms", "q_norm and k_norm are set together")
    vector("q_norm", b.q_norm, shape.head_dim, optional=True)
    vector("k_norm", b.k_norm, shape.head_dim, optional=True)
    for name, table in (("cos", b.cos), ("sin", b.sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != shape.head_dim // 2:
            fail(
                name,
                f"must be float32 [positions, {shape.head_dim // 2}], got {table.dtype} {list(table.shape)}",
            )
        if not table.is_contiguous():
            fail(name, "must be contiguous")
