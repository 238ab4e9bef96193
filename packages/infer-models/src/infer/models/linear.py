"""Linear layers: `x @ weight.T + bias`, with the one CPU path that needs care.

On a CPU, fp32 `F.linear` of a few rows is a BLAS matrix-vector product, which the bundled MKL
runs on one thread: on the CI-class 2-core machine it reads a weight that is not in cache at
~15 GB/s of the ~40 GB/s the machine gives, and a decode step is nothing but such products
(SmolLM2's decode spent 32 of its 45 ms a token in them). `dense_linear` splits the weight's
rows into `CPU_SPLIT` parts and runs them as one batched product, which torch spreads over its
threads: the same arithmetic for each output (one row of the weight against x), at ~38 GB/s.
Larger inputs (prefill chunks), other dtypes (bf16's `F.linear` reads at ~25 GB/s there, its
batched product at ~14) and other devices keep `F.linear`.
"""

import torch
import torch.nn.functional as F
from torch import nn

# At most this many rows take the split path: measured on the 2-core CI machine, the batched
# product reads at 35-38 GB/s up to 4 rows and falls to F.linear's speed from 8.
CPU_SPLIT_MAX_ROWS = 4
CPU_SPLIT = 8  # parts of the weight's rows: more than the threads, so that they share the work evenly


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, x `[M, in]`; for fp32 on a CPU with M <= CPU_SPLIT_MAX_ROWS
    as one batched product over CPU_SPLIT row blocks of the weight (see the module)."""
    num_out = weight.shape[0]
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[0] > CPU_SPLIT_MAX_ROWS
        or num_out % CPU_SPLIT
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    num_rows, num_in = x.shape
    parts = weight.view(CPU_SPLIT, num_out // CPU_SPLIT, num_in)
    out = torch.bmm(parts, x.t().unsqueeze(0).expand(CPU_SPLIT, num_in, num_rows))  # [parts, out/parts, M]
    out = out.view(num_out, num_rows).t()
    if num_rows > 1:
        out = out.contiguous()
    return out if bias is None else out + bias


class Linear(nn.Module):
    """`x @ weight.T + bias` with uninitialised parameters: every weight comes from a checkpoint,
    and skipping nn.Linear's random init keeps building a model on the meta device instant."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)
