"""Programmatic dependent launch (PDL): each kernel of a step lets the next one launch early.

On a stream, a kernel normally starts only once the kernel before it has finished: its launch,
the scheduling of its programs and their start-up all sit between the two. A batch-1 decode step
is a few hundred short kernels, so that gap is paid a few hundred times a token. With PDL (CUDA
on compute capability 9.0 and newer), a kernel launched with the `launch_pdl` attribute may be
scheduled as soon as every program of the kernel before it has called `gdc_launch_dependents`.

Every kernel of infer.kernels, launched with `pdl=True` (a keyword of every op), begins with
`await_inputs`:
- `gdc_launch_dependents` first: the next kernel may launch at once, while this one waits and
  runs. That one releases its own next kernel at once too, so several kernels of a chain may be
  resident together, each waiting on the one before. (A kernel releases only once all of its
  programs have started, so one of several waves holds back the kernels after it until its last
  wave starts, and the programs of a running kernel are never kept from the GPU by later ones.)
- then `gdc_wait`: it returns once the kernel before has completed and its writes are visible.
  That kernel waited in turn, so every kernel before it has completed too. Every write comes
  after the wait, so no kernel writes memory that an earlier one may still read.
- Before its wait a kernel may read only memory that no kernel of the chain writes: since any
  earlier kernel may still run then, anything else could be read stale. That memory is the
  weights, the step's inputs (token positions, cache slots, row lengths, block tables, copied
  before the chain's first kernel), the rope tables, and keys and values stored by earlier
  steps. Reads of it before the wait: the GEMV's first weight tile (gemv.streaming's
  `_gemv_kernel`), normed_gemv's tile with its norms' weights, and normed_gated_gemv's first
  gate and up tiles; decode attention's row length, block table and first tile of keys, all
  but this step's own key (paged_attention's `_decode_split_kernel`); the norms' weights
  (rms_norm); the position, table row and cache slot of a token (rope, qk_norm_rope) and the
  head norms' weights (qk_norm_rope). Each of those chains of dependent loads then overlaps
  the kernels before, not only the one just before.

A kernel that is not ours (cuBLAS, torch) or a copy starts a new chain: the kernel after it
launches once it has completed.

What overlaps is a kernel's launch, start-up and reads before its wait with the kernels before it.

That pays where kernels are short single waves, as in a batch-1 decode step, and costs where they
are long multi-wave ones (prompt chunks): the models built with `KernelPolicy.use_pdl`
(EngineConfig.use_pdl) launch with it their one-row inputs only (infer.models.kernel_policy, with
the measurements). The option travels with each launch, so a kernel captured into a CUDA graph
keeps it, and the graph's replays keep the edges.
"""

import functools

import torch
import triton
import triton.language as tl


def launch_options(t: torch.Tensor, pdl: bool) -> dict:
    """The launch keywords of a kernel whose tensors live on t's device: with `pdl` on a device
    that supports it, `PDL` (the constexpr that compiles `await_inputs` in) and Triton's
    `launch_pdl`; else `PDL=False` alone."""
    if pdl and t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if _supports_pdl(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """With PDL: release the next kernel, then wait for the one before. A kernel's first
    statement, but for the reads the module docstring lists."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
