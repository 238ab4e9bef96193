"""The one-row product of a dense weight: `gemv(x, weight, bias)`, `x @ weight.T + bias` for one row
x and a weight in x's dtype (bf16, fp16, fp32), accumulated in fp32.

It runs the 8-bit GEMV's streaming loop unscaled (`_dense_gemv_kernel`, gemv.streaming), which at
the 1-2B models' widths reads the weight faster than cuBLAS's GEMV does and, being ours, takes
part in programmatic dependent launch (`_dense_gemv_config` has its tiles). Under PDL it loads
its first weight tile before waiting for the kernel before (no kernel writes a weight), so that
the weight stream starts while that kernel ends. With a gated MLP's `[gate; up]` weight it also
applies the activation (`gated_gemv`, gemv.gated): each program streams the up rows of its gate
rows and writes `act(gate) * up`, one kernel where the unfused pair takes two.
"""

import torch
import triton

from infer.kernels._dispatch import use_triton
from infer.kernels.gemv.configs import _dense_gemv_config, _gated_gemv_config, _k_split
from infer.kernels.gemv.references import _check_gemv, gemv_ref
from infer.kernels.gemv.streaming import _dense_gemv_kernel, _empty_product, _rows_and_output, _sum_splits
from infer.kernels.pdl import launch_options


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """`x @ weight.T + bias` for one row x (`[..., K]` holding K values) and a dense weight `[N, K]`
    of x's dtype, accumulated in fp32: the 8-bit GEMV's kernel, unscaled.

    For batch-1 decode on a GPU: at the 1-2B models' widths it streams the weight faster than
    cuBLAS's GEMV does, and under programmatic dependent launch (`infer.kernels.pdl`) it overlaps
    its neighbours as cuBLAS's kernels cannot (docs/benchmarks/generation.md#one-row-gemv).
    """
    _check_gemv(x, weight, bias)
    if use_triton(x):
        return _launch(x, weight, bias, pdl=pdl)
    return gemv_ref(x, weight, bias)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    config: dict | None = None,
    split_k: int | None = None,
    activation: str | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Run the dense GEMV. `config` and `split_k` override the choice by shape (for tests and
    tuning). `activation` ("silu" or "gelu_tanh"; one row): `gated_gemv`, whose weight's first
    half of rows is the gate, and whose output is the gated activation, half as wide. `pdl`:
    launch with programmatic dependent launch (infer.kernels.pdl)."""
    N, K = weight.shape
    gated = activation is not None
    if gated:
        if config is None:
            config = _gated_gemv_config(N, K)
        N //= 2
        split_k = 1  # the activation needs whole sums
    x, rows, out = _rows_and_output(x, N)
    M = rows.shape[0]
    if M == 0 or N == 0 or K == 0:
        return _empty_product(out, bias, x)
    config = dict(_dense_gemv_config(N, K) if config is None else config)
    block_k = config["BLOCK_K"]
    if block_k % config.get("FOLD", 1):
        raise ValueError(f"FOLD {config['FOLD']} does not divide BLOCK_K {block_k}")
    tiles = M * triton.cdiv(N, config["BLOCK_N"])
    splits, k_per_split = _k_split("gemv", config, tiles, M, K, split_k, x.device)
    target = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    if gated and (M != 1 or splits > 1):
        raise ValueError("the gated GEMV takes one row of x and no K split")
    config.pop("FAST_INT8", None)  # a dense weight converts as loaded
    config.setdefault("UNROLL", 1)
    config.setdefault("FOLD", 1)
    options = launch_options(x, pdl)
    _dense_gemv_kernel[(M, triton.cdiv(N, config["BLOCK_N"]), splits)](
        rows,
        weight,
        bias if bias is not None else weight,  # any pointer when there is no bias: not read
        target,
        N,
        K,
        rows.stride(0),
        M * N if splits > 1 else 0,
        N,
        k_per_split,
        **options,
        HAS_BIAS=bias is not None and splits == 1,
        GATED=gated,
        GELU_TANH=activation == "gelu_tanh",
        **config,
    )
    if splits > 1:
        _sum_splits(target, bias, out, options)
    return out.view(*x.shape[:-1], N)
