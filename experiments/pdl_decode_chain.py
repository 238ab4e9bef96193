"""Where does programmatic dependent launch pay: by the number of rows a step's kernels serve.

A question for `EngineConfig.use_pdl` (issues 15 and 16). Layers of Qwen3-8B's projections with
their norms and gated activation run from one CUDA graph, launched plainly and with `pdl=True`
(infer.kernels.pdl), at 1 to 256 rows:
- int8 per channel through `quantized_linear` (every kernel in the chain is ours, so each one
  takes part in PDL);
- bf16 through cuBLAS (`F.linear`), where only the norms and the activation take part.

The answer on an H100 (2026-11-26; timed then by the wall-clock mean of 20 replays, not yet with
`streamed_us`), ms a replay, PDL / plain: int8 0.964 / 0.986 at one row, but
1.02-1.09x slower from 4 to 32 rows, and 4.92 / 3.58 at 256; bf16 0.99-1.00x at 1-256 rows. So the
engine gives PDL to one-token inputs only (`infer.models.linear_method.launches_pdl`);
docs/benchmarks/generation.md #pdl has the figures. Needs a CUDA GPU of compute capability 9.0
or more.

    PYTHONPATH=kernels-bench python experiments/pdl_decode_chain.py [--rows 1,4,8,16,32,64,256]
"""

import argparse

import torch
import torch.nn.functional as F
import triton
from sweep_quantized_gemv import streamed_us

from infer.kernels import quantized_linear, rms_norm, silu_and_mul

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # q|k|v, o, gate|up, down
INT8_LAYERS, BF16_LAYERS = 12, 4  # about 0.8 GB of weights each: more than the L2 holds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,256")
    rows = [int(m) for m in parser.parse_args().rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    int8 = [
        [
            (
                torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=gen),
                torch.rand(shape[0], 1, device="cuda", generator=gen) / 3000,
            )
            for shape in SHAPES
        ]
        for _ in range(INT8_LAYERS)
    ]
    bf16 = [
        [torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16) / 64 for shape in SHAPES]
        for _ in range(BF16_LAYERS)
    ]
    norm = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    inputs = {m: torch.randn(m, 4096, device="cuda", generator=gen).to(torch.bfloat16) for m in rows}

    def int8_chain(m: int, pdl: bool) -> torch.Tensor:
        x = inputs[m]
        for qkv, o, gate_up, down in int8:
            a = quantized_linear(rms_norm(x, norm, 1e-6, pdl=pdl), *qkv, (1, 4096), pdl=pdl)
            b = quantized_linear(a[:, :4096], *o, (1, 4096), pdl=pdl)
            c = quantized_linear(rms_norm(b, norm, 1e-6, pdl=pdl), *gate_up, (1, 4096), pdl=pdl)
            x = quantized_linear(silu_and_mul(c, pdl=pdl), *down, (1, 12288), pdl=pdl)
        return x

    def bf16_chain(m: int, pdl: bool) -> torch.Tensor:
        x = inputs[m]
        for qkv, o, gate_up, down in bf16:
            a = F.linear(rms_norm(x, norm, 1e-6, pdl=pdl), qkv)
            b = F.linear(a[:, :4096], o)
            c = F.linear(rms_norm(b, norm, 1e-6, pdl=pdl), gate_up)
            x = F.linear(silu_and_mul(c, pdl=pdl), down)
        return x

    def replay_ms(chain, m: int, pdl: bool) -> float:
        # A captured launch keeps its launch mode.
        return streamed_us([lambda: chain(m, pdl)], repeats=20) / 1e3

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| chain | rows | plain ms (two runs) | PDL ms (two runs) | PDL / plain |\n|---|---:|---|---|---:|")
    chains = {f"int8, {INT8_LAYERS} layers": int8_chain, f"bf16, {BF16_LAYERS} layers": bf16_chain}
    for name, chain in chains.items():
        for m in rows:
            plain, pdl = [], []
            for _ in range(2):  # alternated
                plain.append(replay_ms(chain, m, False))
                pdl.append(replay_ms(chain, m, True))
            print(
                f"| {name} | {m} | {plain[0]:.3f} / {plain[1]:.3f} | {pdl[0]:.3f} / {pdl[1]:.3f} | "
                f"{min(pdl) / min(plain):.3f} |"
            )


if __name__ == "__main__":
    main()
