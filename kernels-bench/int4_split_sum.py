"""int4_linear's one-row GEMV with its split-K parts summed in the GEMV (`SUM_IN_THE_GEMV`) against
the sum kernel after it, on Qwen3-8B's shapes: µs a call back to back on distinct weights from
one CUDA graph (the best of three alternated runs), then once with PDL as the model launches
them; and whether the outputs are equal bit for bit: the first weight's, then 200 calls in the
GEMV (PDL on every other one) against the sum kernel's output of the same weight. Needs a CUDA GPU.

    python kernels-bench/int4_split_sum.py
"""

import functools
import importlib

import torch
from sweep_quantized_gemv import SHAPES, quantized_weights, streamed_us

# The module, not the function infer.kernels exports under its name.
int4_linear = importlib.import_module("infer.kernels.gemv.int4_linear")


def launch(x: torch.Tensor, weight: tuple, in_the_gemv: bool, pdl: bool = False) -> torch.Tensor:
    int4_linear.SUM_IN_THE_GEMV = in_the_gemv
    return int4_linear._launch(x, *weight, None, pdl=pdl)


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    for name, (n, k) in SHAPES.items():
        weights = quantized_weights("int4", n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        equal = torch.equal(launch(x, weights[0], True), launch(x, weights[0], False))
        expected = [launch(x, weight, False) for weight in weights]
        for i in range(200):  # each count reset for the next call, each sum whole
            got = launch(x, weights[i % len(weights)], True, pdl=i % 2 == 1)
            equal = equal and torch.equal(got, expected[i % len(weights)])
        times = {True: [], False: []}
        for _ in range(3):
            for flag in (True, False):
                int4_linear.SUM_IN_THE_GEMV = flag
                times[flag].append(
                    streamed_us([functools.partial(int4_linear._launch, x, *w, None) for w in weights])
                )
        pdl = {}
        for flag in (True, False):
            int4_linear.SUM_IN_THE_GEMV = flag
            launches = [functools.partial(int4_linear._launch, x, *w, None, pdl=True) for w in weights]
            pdl[flag] = streamed_us(launches)
        int4_linear.SUM_IN_THE_GEMV = True
        print(
            f"{name}: in the GEMV {min(times[True]):.2f} us, sum kernel after {min(times[False]):.2f} us; "
            f"with PDL {pdl[True]:.2f} / {pdl[False]:.2f}; outputs equal: {equal}",
            flush=True,
        )


if __name__ == "__main__":
    main()
