"""A sublayer's pre-norm and the projection after it, as one module: `(proj(norm(x + residual)),
the new residual)`, or for a gate/up projection `act(gate) * up` of it.

`PreNormProjection` runs the norm's kernel (the residual updated in place), then the projection's
method. Where the kernel policy allows it, `apply_kernel_policy` swaps in `NormedGemvProjection`,
which runs a row in one kernel (infer.kernels' `normed_gemv`, or `normed_gated_gemv` with the
activation) and returns a new residual, leaving the one passed in as it was: callers hand on
whichever residual they got. Both hold the block's norm and Linear by reference, so that the
parameters keep the names the block gives them (and the checkpoint's).

A sandwich norm (Gemma's post-attention and post-feedforward norms) joins the residual first:
with `x_norm`, the new residual is `residual + x_norm(x)`, in the same kernel.
"""

import torch
from torch import nn

from infer.kernels import normed_gated_gemv, normed_gemv


class PreNormProjection(nn.Module):
    def __init__(self, norm: nn.Module, proj: nn.Module, *, activation: str | None = None):
        """`norm`: an infer.models.common.RMSNorm; `proj`: an infer.models.linear.Linear;
        `activation` ("silu", "gelu_tanh"): `proj` is a gate/up projection, followed by it."""
        super().__init__()
        # A tuple, not attributes: nn.Module would register them as children a second time.
        self.parts = (norm, proj)
        self.activation = activation

    @property
    def norm(self) -> nn.Module:
        return self.parts[0]

    @property
    def proj(self) -> nn.Module:
        return self.parts[1]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, x_norm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the projection of the normed stream, the residual). `residual` None: `x` is the stream
        (the first block), and becomes the residual."""
        if residual is None:
            normed, residual = self.norm(x), x
        else:
            normed, residual = self.norm.add_and_norm(x, residual, x_norm=x_norm)
        if self.activation is None:
            return self.proj(normed), residual
        return self.proj.gated(normed, self.activation), residual


class NormedGemvProjection(PreNormProjection):
    """`PreNormProjection` with a row (batch-1 decode) in one Triton kernel; more rows, and the
    first block's, as its parent. Built by the policy only for a dense projection without bias
    of a row of at most normed_gemv's MAX_K values, on CUDA with the Triton GEMV, and, for a
    gate/up projection, where the kernel's grid is one wave (where it was faster than the norm's
    kernel and the gated GEMV). `pdl`: the kernel launches with programmatic dependent launch."""

    def __init__(self, norm: nn.Module, proj: nn.Module, *, activation: str | None = None, pdl: bool = False):
        super().__init__(norm, proj, activation=activation)
        self.pdl = pdl

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, x_norm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm, proj = self.parts
        if residual is None or x.numel() != proj.in_features:
            return super().forward(x, residual, x_norm=x_norm)
        args = (x, residual, norm.weight, proj.weight, norm.eps)
        options = dict(offset=norm.offset, x_norm_weight=norm.x_norm_weight(x_norm), pdl=self.pdl)
        if self.activation is None:
            return normed_gemv(*args, **options)
        return normed_gated_gemv(*args, activation=self.activation, **options)
