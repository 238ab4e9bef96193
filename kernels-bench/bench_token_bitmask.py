"""apply_token_bitmask over Llama 3's vocabulary (128256 float32 logits a row): every row of a
batch constrained by a grammar, at batch 1, 16 and 64. Triton vs eager reference vs torch.compile."""

import pytest
import torch
from harness import IMPLS, Case

from infer.kernels import apply_token_bitmask, apply_token_bitmask_ref

VOCAB_SIZE = 128256
NUM_WORDS = -(-VOCAB_SIZE // 32)
BATCHES = [1, 16, 64]


def make_inputs(rows: int) -> tuple:
    logits = torch.randn(rows, VOCAB_SIZE, device="cuda", dtype=torch.float32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, NUM_WORDS), device="cuda", dtype=torch.int64)
    return logits, bitmask.to(torch.int32), torch.arange(rows, device="cuda")


def cases() -> list[Case]:
    return [
        Case(
            op="token_bitmask",
            shape=f"{rows} rows, vocab {VOCAB_SIZE}",
            tokens=rows,
            # The bits read, and -inf written where a bit is 0: half the logits of random words.
            bytes_moved=rows * (VOCAB_SIZE * 4 // 2 + NUM_WORDS * 4),
            make_inputs=lambda r=rows: make_inputs(r),
            triton_fn=apply_token_bitmask,
            eager_fn=apply_token_bitmask_ref,
        )
        for rows in BATCHES
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_token_bitmask(bench_op, case, impl):
    bench_op(case, impl)
