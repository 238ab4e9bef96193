"""rms_norm_add_rms_norm (Gemma's sandwich-norm join): Triton vs eager reference vs torch.compile,
bf16, beside the two Triton launches it replaces (op `rms_norm+add_rms_norm`, same shapes): the
ratio of the two rows' Triton times is what the fusion saves."""

import pytest
from harness import DECODE_TOKENS, DTYPE, IMPLS, MODEL_SIZES, PREFILL_TOKENS, Case, gpu_tensor

from infer.kernels import add_rms_norm, rms_norm, rms_norm_add_rms_norm, rms_norm_add_rms_norm_ref


def unfused(x, residual, weight, next_weight, eps):
    """What the model launched before the fusion: two kernels, x's norm round-tripping HBM."""
    return add_rms_norm(rms_norm(x, weight, eps), residual, next_weight, eps)


def cases() -> list[Case]:
    out = []
    for hidden, _ in MODEL_SIZES:
        for tokens in DECODE_TOKENS + PREFILL_TOKENS:
            for op, triton_fn in (
                ("rms_norm_add_rms_norm", rms_norm_add_rms_norm),
                ("rms_norm+add_rms_norm", unfused),
            ):
                out.append(
                    Case(
                        op=op,
                        shape=f"{tokens}x{hidden}",
                        tokens=tokens,
                        # read x and residual, write residual and the normed output, read two weights
                        bytes_moved=(4 * tokens * hidden + 2 * hidden) * DTYPE.itemsize,
                        make_inputs=lambda t=tokens, h=hidden: (
                            gpu_tensor(t, h),
                            gpu_tensor(t, h),
                            gpu_tensor(h),
                            gpu_tensor(h),
                            1e-6,
                        ),
                        triton_fn=triton_fn,
                        eager_fn=rms_norm_add_rms_norm_ref,
                    )
                )
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_rms_norm_add_rms_norm(bench_op, case, impl):
    bench_op(case, impl)
