"""Is the MLP's pre-norm inside its gate/up GEMV (`normed_gated_gemv`: the gated GEMV's tiles, each
scaled by the norm's weight, the sums by the inverse RMS) faster than the norm's kernel and
`gated_gemv` (issue 15)? Needs a CUDA GPU of compute capability 9.0 or newer.

Per shape (the 1-2B models' gate|up with their norms: Gemma's sandwich pair, Llama's and Qwen's
add-and-norm), µs a call of each way, streamed back to back from one CUDA graph over distinct
weight copies (more than the L2 holds) under programmatic dependent launch: `gated_gemv` alone
(no norm), the norm's kernel then `gated_gemv`, and the fused kernel under each of its tiles
and warps, set through its module constants.

    PYTHONPATH=kernels-bench python experiments/normed_gated_probe.py
"""

import importlib

import torch
import triton
from sweep_quantized_gemv import streamed_us

from infer.kernels import add_rms_norm, gated_gemv, rms_norm_add_rms_norm

module = importlib.import_module(
    "infer.kernels.gemv.normed"
)  # infer.kernels exports a function under its name

# (hidden, intermediate, sandwich, activation)
SHAPES = {
    "gemma-3-1b": (1152, 6912, True, "gelu_tanh"),
    "llama-3.2-1b": (2048, 8192, False, "silu"),
    "qwen3-1.7b": (2048, 6144, False, "silu"),
}
STREAMED_BYTES = 300e6
# (_NORMED_GATED_BLOCK_N, _NORMED_GATED_BLOCK_K, _NORMED_GATED_NUM_WARPS)
CONFIGS = [(8, 256, 2), (8, 256, 4), (4, 256, 2), (8, 128, 2), (16, 256, 4), (16, 128, 4)]
NAMES = ("_NORMED_GATED_BLOCK_N", "_NORMED_GATED_BLOCK_K", "_NORMED_GATED_NUM_WARPS")


def shape_row(hidden: int, intermediate: int, sandwich: bool, activation: str, gen) -> list[float]:
    """µs a call: `gated_gemv` alone, the norm's kernel and `gated_gemv`, then the fused kernel
    under each of CONFIGS."""
    copies = max(2, int(STREAMED_BYTES // (2 * intermediate * hidden * 2)))
    weights = [
        torch.randn(2 * intermediate, hidden, generator=gen, device="cuda").to(torch.bfloat16) / 32
        for _ in range(copies)
    ]
    x, residual = torch.randn(2, 1, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    norm_weight, x_norm_weight = torch.randn(2, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    offset = 1.0 if sandwich else 0.0
    x_weight = x_norm_weight if sandwich else None

    def unfused(w):
        if sandwich:
            normed, _ = rms_norm_add_rms_norm(
                x, residual, x_norm_weight, norm_weight, 1e-6, offset=offset, pdl=True
            )
        else:
            normed, _ = add_rms_norm(x, residual, norm_weight, 1e-6, offset=offset, pdl=True)
        return gated_gemv(normed, w, activation=activation, pdl=True)

    def fused(w):
        options = dict(activation=activation, offset=offset, x_norm_weight=x_weight, pdl=True)
        return module.normed_gated_gemv(x, residual, norm_weight, w, 1e-6, **options)

    row = []
    defaults = [getattr(module, name) for name in NAMES]
    alone = [lambda w=w: gated_gemv(x, w, activation=activation, pdl=True) for w in weights]
    row.append(streamed_us(alone, repeats=7))
    row.append(streamed_us([lambda w=w: unfused(w) for w in weights], repeats=7))
    for config in CONFIGS:
        for name, value in zip(NAMES, config, strict=True):
            setattr(module, name, value)
        row.append(streamed_us([lambda w=w: fused(w) for w in weights], repeats=7))
    for name, value in zip(NAMES, defaults, strict=True):
        setattr(module, name, value)
    return row


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator("cuda").manual_seed(0)
    fused = " | ".join(f"fused {c}" for c in CONFIGS)
    print(f"| shape | gated_gemv alone | norm + gated_gemv | {fused} |")
    print("|---|---:|---:|" + "---:|" * len(CONFIGS))
    for name, shape in SHAPES.items():
        row = shape_row(*shape, gen)
        print(f"| {name} | " + " | ".join(f"{us:.2f}" for us in row) + " |", flush=True)


if __name__ == "__main__":
    main()
