"""silu_and_mul and gelu_tanh_and_mul: Triton vs eager reference vs torch.compile, bf16.

Shapes are [tokens, 2 * intermediate] with the intermediate size of each model in MODEL_SIZES.
"""

import pytest
from harness import DECODE_TOKENS, DTYPE, IMPLS, MODEL_SIZES, PREFILL_TOKENS, Case, gpu_tensor

from infer.kernels import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref

OPS = {
    "silu_and_mul": (silu_and_mul, silu_and_mul_ref),
    "gelu_tanh_and_mul": (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
}


def cases() -> list[Case]:
    out = []
    for op_name, (op, ref) in OPS.items():
        for hidden, intermediate in MODEL_SIZES:
            for tokens in DECODE_TOKENS + PREFILL_TOKENS:
                out.append(
                    Case(
                        op=op_name,
                        shape=f"{tokens}x2x{intermediate} (hidden {hidden})",
                        tokens=tokens,
                        bytes_moved=3 * tokens * intermediate * DTYPE.itemsize,  # read gate, up; write out
                        make_inputs=lambda t=tokens, i=intermediate: (gpu_tensor(t, 2 * i),),
                        triton_fn=op,
                        eager_fn=ref,
                    )
                )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_activation(bench_op, case, impl):
    bench_op(case, impl)
