"""rms_norm: Triton vs eager reference vs torch.compile, decode and prefill, bf16."""

import pytest
from harness import DECODE_TOKENS, DTYPE, IMPLS, MODEL_SIZES, PREFILL_TOKENS, Case, gpu_tensor

from infer.kernels import rms_norm, rms_norm_ref


def cases() -> list[Case]:
    out = []
    for hidden, _ in MODEL_SIZES:
        for tokens in DECODE_TOKENS + PREFILL_TOKENS:
            element = DTYPE.itemsize
            out.append(
                Case(
                    op="rms_norm",
                    shape=f"{tokens}x{hidden}",
                    tokens=tokens,
                    bytes_moved=(2 * tokens * hidden + hidden) * element,  # read x, write out, weight
                    make_inputs=lambda t=tokens, h=hidden: (gpu_tensor(t, h), gpu_tensor(h), 1e-6),
                    triton_fn=rms_norm,
                    eager_fn=rms_norm_ref,
                )
            )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_rms_norm(bench_op, case, impl):
    bench_op(case, impl)
