"""A probe for issue 16's CPU target: one-row int8 GEMVs of SmolLM2's shapes through ATen's
`_weight_int8pack_mm` (what `infer.kernels.cpu.int8_linear` calls) against Inductor's C++ GEMM
template for the same op (`torch.compile` with max-autotune and freezing, the CPP backend only).

Each shape runs as one module of `copies` calls on distinct weights (more bytes than the caches
hold), eager and compiled, alternated in one process; x and the scales in bf16, as
`int8_linear_cpu` passes them. The template needs its weights to be constants (freezing), so a
model would need one compile per weight: this measures the kernel, not a way to ship it.

    python experiments/cpu_int8_gemv_inductor.py [qkv o gate_up down lm_head]
"""

import sys
import time

import torch
import torch._inductor.config as inductor_config

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
STREAMED_BYTES = 64e6


class Calls(torch.nn.Module):
    def __init__(self, weights: list[torch.Tensor], scales: list[torch.Tensor]):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])
        self.scales = torch.nn.ParameterList([torch.nn.Parameter(s, requires_grad=False) for s in scales])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch._weight_int8pack_mm(x, w, s) for w, s in zip(self.weights, self.scales, strict=True)]


def us_per_call(module: torch.nn.Module, x: torch.Tensor, calls: int, repeats: int = 20) -> float:
    for _ in range(3):
        module(x)
    start = time.perf_counter()
    for _ in range(repeats):
        module(x)
    return (time.perf_counter() - start) / (repeats * calls) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    inductor_config.freezing = True
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm_backends = "CPP"
    torch.manual_seed(0)
    with torch.no_grad():
        for name in sys.argv[1:] or list(SHAPES):
            n, k = SHAPES[name]
            copies = max(2, int(STREAMED_BYTES // (n * k)))
            weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
            scales = [(torch.rand(n) * 0.01).to(torch.bfloat16) for _ in range(copies)]
            eager = Calls(weights, scales)
            x = torch.randn(1, k).to(torch.bfloat16)
            started = time.perf_counter()
            compiled = torch.compile(eager, dynamic=False)
            outputs = compiled(x)
            compile_s = time.perf_counter() - started
            worst = max(
                ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                for out, ref in zip(outputs, eager(x), strict=True)
            )
            for _ in range(2):
                aten, inductor = us_per_call(eager, x, copies), us_per_call(compiled, x, copies)
                print(
                    f"{name} {n}x{k}, {copies} weights: ATen {aten:.1f} µs ({n * k / aten / 1e3:.1f} GB/s), "
                    f"Inductor {inductor:.1f} µs ({n * k / inductor / 1e3:.1f} GB/s); worst relative "
                    f"difference {worst:.1e}; compiled in {compile_s:.0f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
