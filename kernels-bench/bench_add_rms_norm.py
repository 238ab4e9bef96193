"""add_rms_norm (residual add + RMSNorm): Triton vs eager reference vs torch.compile, bf16."""

import pytest
from harness import DECODE_TOKENS, DTYPE, IMPLS, MODEL_SIZES, PREFILL_TOKENS, Case, gpu_tensor

from infer.kernels import add_rms_norm, add_rms_norm_ref


def cases() -> list[Case]:
    out = []
    for hidden, _ in MODEL_SIZES:
        for tokens in DECODE_TOKENS + PREFILL_TOKENS:
            out.append(
                Case(
                    op="add_rms_norm",
                    shape=f"{tokens}x{hidden}",
                    tokens=tokens,
                    # read x and residual, write residual and the normed output, read weight
                    bytes_moved=(4 * tokens * hidden + hidden) * DTYPE.itemsize,
                    make_inputs=lambda t=tokens, h=hidden: (
                        gpu_tensor(t, h),
                        gpu_tensor(t, h),
                        gpu_tensor(h),
                        1e-6,
                    ),
                    triton_fn=add_rms_norm,
                    eager_fn=add_rms_norm_ref,
                )
            )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_add_rms_norm(bench_op, case, impl):
    bench_op(case, impl)
