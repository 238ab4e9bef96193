"""The one-row and few-row linear kernels, by weight format (Triton on CUDA, PyTorch references on
the CPU); `infer.kernels` exports their public names.

- `dense`: `gemv`, a one-row product of a weight in x's dtype.
- `quantized`: `quantized_linear`, 8-bit weights (int8, fp8) with their scales, for any rows.
- `int4_layout`, `int4_linear` and `int4` (its kernels): `int4_linear`, packed 4-bit weights;
  `int4_gemv` its one-row GEMV, and `int4_mma` one on tensor cores (in Gluon; `kernel="mma"`).
- `gated`: a gated MLP's gate/up projection and its activation in one kernel, for each format.
- `normed`: `normed_gemv`, `normed_gated_gemv`, a pre-norm inside the projection after it.
- `streaming`: the one-row GEMV kernel that dense and 8-bit weights share, and the sum of K splits.
- `configs`: every tile and K-split choice, by shape, with what measured it.
- `references`: each op's input checks and its plain-PyTorch reference (`*_ref`).
"""
