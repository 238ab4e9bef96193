"""Fused kernels for LLM inference: Triton on CUDA, PyTorch references on the CPU.

Each op has one public function that checks its inputs and dispatches, and a `*_ref` twin in
plain PyTorch that is the test oracle and the CPU path, except where a CPU path of its own is
faster (`paged_attention_cpu`, `rms_norm_cpu`, `rope_cpu`, `int8_linear_cpu`, `bf16_linear_cpu`,
`gguf_linear_cpu`, each tested against its reference). `DecoderStackCpu` runs a model's blocks for
a CPU step of decode rows in one C call (`decoder_stack_cpu_ref` composes the ops' references).
"""

from infer.kernels._version import INTERFACE_VERSION, __version__
from infer.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref
from infer.kernels.argmax import argmax, argmax_ref
from infer.kernels.cpu.bf16_linear import (
    bf16_linear_cpu,
    bf16_linear_cpu_native,
    bf16_linear_cpu_ref,
    bf16_linear_cpu_supports,
)
from infer.kernels.cpu.decoder_stack import CpuBlock, CpuHead, CpuLinear, CpuStackShape, DecoderStackCpu
from infer.kernels.cpu.decoder_stack_reference import decoder_stack_cpu_ref
from infer.kernels.cpu.gguf_linear import (
    GGUF_FORMATS,
    GGUF_REPACKED,
    dequantize_gguf,
    gguf_cpu_variants,
    gguf_file_format,
    gguf_file_rows,
    gguf_linear_cpu,
    gguf_linear_cpu_native,
    gguf_linear_cpu_q8_ref,
    gguf_linear_cpu_ref,
    gguf_linear_cpu_supports,
    gguf_row_bytes,
    repack_gguf,
    use_gguf_cpu_variant,
)
from infer.kernels.cpu.int8_linear import (
    Int8CpuScale,
    int8_cpu_scale,
    int8_linear_cpu,
    int8_linear_cpu_supports,
)
from infer.kernels.cpu.native import native_cpu_kernels_available
from infer.kernels.gemv.dense import gemv
from infer.kernels.gemv.gated import gated_gemv, int4_gated_gemv, quantized_gated_gemv
from infer.kernels.gemv.int4_layout import pack_int4, unpack_int4
from infer.kernels.gemv.int4_linear import int4_linear
from infer.kernels.gemv.normed import normed_gated_gemv, normed_gated_gemv_fills_one_wave, normed_gemv
from infer.kernels.gemv.quantized import quantized_linear
from infer.kernels.gemv.references import (
    dequantize_int4,
    dequantize_weight,
    gated_gemv_ref,
    gemv_ref,
    int4_gated_gemv_ref,
    int4_linear_ref,
    normed_gated_gemv_ref,
    normed_gemv_ref,
    quantized_gated_gemv_ref,
    quantized_linear_ref,
)
from infer.kernels.paged_attention import (
    decode_warm_up_lengths,
    extend_tile_size,
    paged_attention,
    paged_attention_cpu,
    paged_attention_ref,
)
from infer.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from infer.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_add_rms_norm,
    rms_norm_add_rms_norm_ref,
    rms_norm_cpu,
    rms_norm_ref,
)
from infer.kernels.rope import rope, rope_cpu, rope_ref
from infer.kernels.rotary_tables import rope_tables
from infer.kernels.store_kv import KVStore, store_kv, store_kv_ref
from infer.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref
from infer.kernels.tolerance import TOLERANCES, Tolerance, assert_close, assert_gated_close

__all__ = [
    "CpuBlock",
    "CpuHead",
    "CpuLinear",
    "CpuStackShape",
    "DecoderStackCpu",
    "GGUF_FORMATS",
    "GGUF_REPACKED",
    "INTERFACE_VERSION",
    "Int8CpuScale",
    "KVStore",
    "TOLERANCES",
    "Tolerance",
    "__version__",
    "add_rms_norm",
    "add_rms_norm_ref",
    "argmax",
    "argmax_ref",
    "apply_token_bitmask",
    "apply_token_bitmask_ref",
    "assert_close",
    "assert_gated_close",
    "decode_warm_up_lengths",
    "bf16_linear_cpu",
    "bf16_linear_cpu_native",
    "bf16_linear_cpu_ref",
    "bf16_linear_cpu_supports",
    "decoder_stack_cpu_ref",
    "dequantize_gguf",
    "dequantize_int4",
    "dequantize_weight",
    "extend_tile_size",
    "gated_gemv",
    "gated_gemv_ref",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_ref",
    "gemv",
    "gemv_ref",
    "gguf_cpu_variants",
    "gguf_file_format",
    "gguf_file_rows",
    "gguf_linear_cpu",
    "gguf_linear_cpu_native",
    "gguf_linear_cpu_q8_ref",
    "gguf_linear_cpu_ref",
    "gguf_linear_cpu_supports",
    "gguf_row_bytes",
    "repack_gguf",
    "int4_gated_gemv",
    "int4_gated_gemv_ref",
    "int4_linear",
    "int4_linear_ref",
    "int8_cpu_scale",
    "int8_linear_cpu",
    "int8_linear_cpu_supports",
    "native_cpu_kernels_available",
    "normed_gated_gemv",
    "normed_gated_gemv_fills_one_wave",
    "normed_gated_gemv_ref",
    "normed_gemv",
    "normed_gemv_ref",
    "pack_int4",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "quantized_gated_gemv",
    "quantized_gated_gemv_ref",
    "quantized_linear",
    "quantized_linear_ref",
    "rms_norm",
    "rms_norm_add_rms_norm",
    "rms_norm_add_rms_norm_ref",
    "rms_norm_cpu",
    "rms_norm_ref",
    "rope",
    "rope_cpu",
    "rope_ref",
    "rope_tables",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
    "unpack_int4",
    "use_gguf_cpu_variant",
]
