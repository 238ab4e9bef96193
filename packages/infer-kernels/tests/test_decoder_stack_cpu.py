"""DecoderStackCpu (decoder_stack_cpu.c) against decoder_stack_cpu_ref, the same stack composed
from the ops' PyTorch references: the residual stream it returns and the K/V it writes.

Random blocks of three kinds (pre-norm as Llama, pre-norm with QK norms as Qwen 3, sandwich norms
with (1 + w) scales, gelu and a sliding window as Gemma 3), float32, bf16 and int8 Linears, 1 to
MAX_ROWS rows at different lengths over a shuffled block table. int8 products round each row of x
to int16 (int8_linear_cpu's kernel), which the reference does not: their tolerance is wider. bf16
weights are widened exactly, as the reference's upcast does: float32's tolerance. GGUF
blocks (Q4_1, Q8_0, Q4_0, made by gguf.quants) round x to int8 blocks of 32, and so does the
reference (gguf_linear_cpu_q8_ref): they differ by fp32 sums.
"""

import math
import platform

import pytest
import torch

from infer.kernels import (
    CpuBlock,
    CpuHead,
    CpuLinear,
    CpuStackShape,
    DecoderStackCpu,
    decoder_stack_cpu_ref,
    gguf_file_format,
    repack_gguf,
    rope_tables,
)
from infer.kernels.cpu.decoder_stack import MAX_ROWS

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux"
    or platform.machine() != "x86_64"
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="infer.kernels' C kernels are built for x86-64 Linux with AVX2",
)

HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16
BLOCK_SIZE, NUM_CACHE_BLOCKS, MAX_POSITIONS = 4, 64, 256
VOCAB = 203
KINDS = ("llama", "qwen3", "gemma3")


def make_linear(n: int, k: int, quantized: bool | str, generator: torch.Generator, bias: bool = False):
    """A random [n, k] Linear, `quantized` as make_stack's."""
    weight = torch.randn(n, k, generator=generator) * k**-0.5
    b = torch.randn(n, generator=generator) * 0.1 if bias else None
    if not quantized:
        return CpuLinear(weight, None, b)
    if quantized == "bf16":
        return CpuLinear(weight.to(torch.bfloat16), None, b)
    if isinstance(quantized, str):
        file_format = gguf_file_format(quantized)
        blocks = torch.from_numpy(
            quantize(weight.numpy(), getattr(GGMLQuantizationType, file_format.upper()))
        )
        if quantized != file_format:  # a layout repacked at load ("q8_0x4")
            blocks = repack_gguf(blocks, file_format)
        return CpuLinear(blocks, None, b, gguf_format=quantized)
    scale = weight.abs().amax(dim=1) / 127
    return CpuLinear(torch.round(weight / scale[:, None]).to(torch.int8), scale, b)


def make_stack(kind: str, quantized: bool | str, seed: int = 0, num_blocks: int = 3):
    """`quantized`: False (float32), True (int8 per channel), "bf16" or a GGUF format ("q4_1")."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    def linear(n, k, bias=False):
        return make_linear(n, k, quantized, generator, bias)

    def norm(size):
        return randn(size, scale=0.1) + (0.0 if kind == "gemma3" else 1.0)

    shape = CpuStackShape(
        num_q_heads=Q_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        eps=1e-6,
        norm_offset=1.0 if kind == "gemma3" else 0.0,
        attention_scale=HEAD_DIM**-0.5,
        activation="gelu_tanh" if kind == "gemma3" else "silu",
    )
    blocks = []
    for index in range(num_blocks):
        cos, sin = rope_tables(HEAD_DIM, MAX_POSITIONS, 10_000.0 if index % 2 else 1_000_000.0)
        sandwich = kind == "gemma3"
        blocks.append(
            CpuBlock(
                input_norm=norm(HIDDEN),
                qkv=linear((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, bias=kind == "qwen3"),
                o=linear(HIDDEN, Q_HEADS * HEAD_DIM),
                post_attention_norm=norm(HIDDEN),
                gate_up=linear(2 * INTERMEDIATE, HIDDEN),
                down=linear(HIDDEN, INTERMEDIATE),
                cos=cos,
                sin=sin,
                pre_feedforward_norm=norm(HIDDEN) if sandwich else None,
                post_feedforward_norm=norm(HIDDEN) if sandwich else None,
                q_norm=norm(HEAD_DIM) if kind != "llama" else None,
                k_norm=norm(HEAD_DIM) if kind != "llama" else None,
                sliding_window=5 if sandwich and index % 2 == 0 else None,
            )
        )
    return shape, blocks


def make_step(
    seq_lens: list[int], seed: int = 1, num_blocks: int = 3, block_size: int = BLOCK_SIZE, caches=None
):
    """Caches filled with random keys and values (or `caches`, viewed in blocks of `block_size`),
    a shuffled block table, and the rows' new token (the last of each sequence)."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    num_cache_blocks = NUM_CACHE_BLOCKS * BLOCK_SIZE // block_size
    cache_shape = (num_cache_blocks, block_size, KV_HEADS, HEAD_DIM)
    if caches is None:
        caches = [
            (torch.randn(cache_shape, generator=generator), torch.randn(cache_shape, generator=generator))
            for _ in range(num_blocks)
        ]
    kv_layers = [(k.view(cache_shape), v.view(cache_shape)) for k, v in caches]
    blocks_per_row = max(math.ceil(n / block_size) for n in seq_lens)
    order = torch.randperm(num_cache_blocks, generator=generator)[: rows * blocks_per_row]
    block_tables = order.view(rows, blocks_per_row).to(torch.int32)
    positions = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64)
    slots = torch.tensor(
        [
            int(block_tables[r, p // block_size]) * block_size + p % block_size
            for r, p in enumerate(positions.tolist())
        ]
    )
    residual = torch.randn(rows, HIDDEN, generator=generator)
    return residual, positions, slots, block_tables, torch.tensor(seq_lens, dtype=torch.int32), kv_layers


def clone_step(step):
    residual, positions, slots, tables, lens, kv_layers = step
    return residual.clone(), positions, slots, tables, lens, [(k.clone(), v.clone()) for k, v in kv_layers]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "quantized",
    [False, "bf16", True, "q4_1", "q8_0", "q8_0x4", "q4_0"],
    ids=["float32", "bf16", "int8", "q4_1", "q8_0", "q8_0x4", "q4_0"],
)
@pytest.mark.parametrize("seq_lens", [[1], [7], [3, 9, 14], [2, 5, 6, 8, 11, 13, 16, 21]])
def test_matches_the_reference(kind, quantized, seq_lens):
    assert len(seq_lens) <= MAX_ROWS
    shape, blocks = make_stack(kind, quantized)
    stack = DecoderStackCpu(shape, blocks)
    ours, theirs = clone_step(make_step(seq_lens)), clone_step(make_step(seq_lens))
    stack(*ours)
    decoder_stack_cpu_ref(shape, blocks, *theirs)
    # float32 and bf16 (widened exactly): summation order only; int8: x rounded to int16 per row in
    # each product; GGUF: the reference rounds x the same way, so summation order, and room for one
    # x entry whose rounding the two sums put on either side of a boundary (measured: 3.5e-6 at
    # most over these cases).
    exact = quantized in (False, "bf16")
    tolerance = dict(rtol=1e-4, atol=1e-4) if exact else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(ours[0], theirs[0], **tolerance)
    for (k_ours, v_ours), (k_ref, v_ref) in zip(ours[5], theirs[5], strict=True):
        torch.testing.assert_close(k_ours, k_ref, **tolerance)
        torch.testing.assert_close(v_ours, v_ref, **tolerance)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "quantized", [False, "bf16", True, "q8_0x4"], ids=["float32", "bf16", "int8", "q8_0x4"]
)
@pytest.mark.parametrize("seq_lens", [[7], [3, 9, 14]])
def test_a_stack_given_a_head_writes_the_logits(kind, quantized, seq_lens):
    """The final norm and an LM head of VOCAB rows (not a multiple of four rows a pass) after the
    blocks: the logits against the reference's, the stream as without a head."""
    shape, blocks = make_stack(kind, quantized)
    generator = torch.Generator().manual_seed(9)
    norm = torch.randn(HIDDEN, generator=generator) * 0.1 + (0.0 if kind == "gemma3" else 1.0)
    head = CpuHead(norm, make_linear(VOCAB, HIDDEN, quantized, generator))
    stack = DecoderStackCpu(shape, blocks, head)
    ours, theirs = clone_step(make_step(seq_lens)), clone_step(make_step(seq_lens))
    logits = torch.empty(len(seq_lens), VOCAB)
    stack(*ours, logits=logits)
    expected = decoder_stack_cpu_ref(shape, blocks, *theirs, head=head)
    exact = quantized in (False, "bf16")
    tolerance = dict(rtol=1e-4, atol=1e-4) if exact else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(ours[0], theirs[0], **tolerance)
    torch.testing.assert_close(logits, expected, **tolerance)


def test_a_head_attached_to_a_built_stack_is_checked_then_runs():
    """`attach_head`: a head the C code does not take is refused by name and leaves the stack
    without one; a good one then ends the call with the reference's logits."""
    shape, blocks = make_stack("llama", quantized=False)
    generator = torch.Generator().manual_seed(9)
    norm = torch.randn(HIDDEN, generator=generator) * 0.1 + 1.0
    head = CpuHead(norm, make_linear(VOCAB, HIDDEN, False, generator))
    stack = DecoderStackCpu(shape, blocks)
    with pytest.raises(ValueError, match="the LM head"):
        stack.attach_head(CpuHead(norm, CpuLinear(head.lm_head.weight.double())))
    assert stack.head is None
    stack.attach_head(head)
    ours, theirs = clone_step(make_step([3, 9])), clone_step(make_step([3, 9]))
    logits = torch.empty(2, VOCAB)
    stack(*ours, logits=logits)
    expected = decoder_stack_cpu_ref(shape, blocks, *theirs, head=head)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_caches_at_the_same_address_in_blocks_of_another_size():
    """A new engine's cache may lie where an earlier one's was freed, in blocks of another size:
    the stack must read the new block size, not the one it saw first at that address."""
    shape, blocks = make_stack("llama", quantized=False)
    stack = DecoderStackCpu(shape, blocks)
    first = make_step([9, 14])
    stack(*clone_step(first)[:5], first[5])
    second = make_step([9, 14], seed=2, block_size=2 * BLOCK_SIZE, caches=first[5])
    assert second[5][0][0].data_ptr() == first[5][0][0].data_ptr()
    theirs = clone_step(second)
    stack(*second)
    decoder_stack_cpu_ref(shape, blocks, *theirs)
    torch.testing.assert_close(second[0], theirs[0], rtol=1e-4, atol=1e-4)


def test_the_reference_sees_each_part():
    """The oracle is not blind: perturbing one block's MLP weight changes the stream."""
    shape, blocks = make_stack("gemma3", quantized=False)
    step = make_step([3, 9])
    first, second = clone_step(step), clone_step(step)
    decoder_stack_cpu_ref(shape, blocks, *first)
    blocks[1].down.weight[0, 0] += 1.0
    decoder_stack_cpu_ref(shape, blocks, *second)
    assert not torch.allclose(first[0], second[0])


def test_refuses_what_it_does_not_take():
    shape, blocks = make_stack("llama", quantized=False)
    bad = CpuBlock(**{**blocks[0].__dict__, "o": CpuLinear(blocks[0].o.weight.double())})
    with pytest.raises(ValueError, match="block 0's o"):
        DecoderStackCpu(shape, [bad])
    stack = DecoderStackCpu(shape, blocks)
    residual, positions, slots, tables, lens, kv_layers = make_step([1] * (MAX_ROWS + 1))
    with pytest.raises(ValueError, match="decode rows"):
        stack(residual, positions, slots, tables, lens, kv_layers)
    residual, positions, slots, tables, lens, kv_layers = make_step([3])
    with pytest.raises(ValueError, match="rotary tables"):
        stack(residual, positions + MAX_POSITIONS, slots, tables, lens, kv_layers)
    with pytest.raises(ValueError, match="slot"):
        stack(residual, positions, slots + NUM_CACHE_BLOCKS * BLOCK_SIZE, tables, lens, kv_layers)
    with pytest.raises(ValueError, match="given a head"):
        stack(residual, positions, slots, tables, lens, kv_layers, logits=torch.empty(1, VOCAB))
    generator = torch.Generator().manual_seed(0)
    lm_head = make_linear(VOCAB, HIDDEN, False, generator)
    with pytest.raises(ValueError, match="the head's norm"):
        DecoderStackCpu(shape, blocks, CpuHead(torch.ones(HIDDEN, dtype=torch.float64), lm_head))
    with pytest.raises(ValueError, match="the LM head"):
        DecoderStackCpu(
            shape, blocks, CpuHead(torch.ones(HIDDEN), make_linear(VOCAB, HIDDEN + 8, False, generator))
        )
    headed = DecoderStackCpu(shape, blocks, CpuHead(torch.ones(HIDDEN), lm_head))
    with pytest.raises(ValueError, match=f"logits must be contiguous float32 \\[1, {VOCAB}\\]"):
        headed(residual, positions, slots, tables, lens, kv_layers, logits=torch.empty(1, VOCAB + 1))
