"""Programmatic dependent launch (PDL): each kernel of a step lets the next one launch early.

On a stream, a kernel normally starts only once the kernel before it has finished: its launch,
the scheduling of its programs and their start-up all sit between the two. A batch-1 decode step
is a few hundred short kernels, so that gap is paid a few hundred times a token. With PDL (CUDA
on compute capability 9.0 and newer), a kernel launched with the `launch_pdl` attribute may be
scheduled as soon as every program of the kernel before it has called `gdc_launch_dependents`.

Every kernel of infer.kernels, launched under `programmatic_launch()`, begins with `await_inputs`:
- `gdc_wait` first: it returns once the kernel before has completed and its writes are visible.
  Nothing is read or written before it, so every kernel still sees its inputs complete and never
  writes memory that the kernel before may still read: the order of memory effects is the
  stream's. The exceptions read memory that the kernel before does not write (every kernel
  before that one has completed by then, since it waited in turn before releasing this one):
  the GEMV loads its first weight tile before waiting (quantized_linear's `_gemv_kernel`), and
  decode attention its row's length, block table and first tile of keys, all but this step's
  own key, which the kernel before stores (paged_attention's `_decode_split_kernel`).
- then `gdc_launch_dependents`: the next kernel may launch while this one runs. It waits in turn,
  so at most the next kernel's programs are resident early, not the whole chain's.

What overlaps is the next kernel's launch and start-up with this kernel's work and tail. A kernel
that is not ours (cuBLAS, torch) is launched as usual: the one after it starts when it ends.

That pays where kernels are short single waves, as in a batch-1 decode step, and costs where they
are long multi-wave ones (prompt chunks): the engine uses it for batch-1 decode steps only
(`EngineConfig.use_pdl`, infer.engine.cuda_graphs.launches_with_pdl, with the measurements). The
context manager sets it for the kernels launched inside it, including those captured into a CUDA
graph, whose replays keep the edges.
"""

import contextlib
import functools

import torch
import triton
import triton.language as tl

_enabled = False


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True):
    """Kernels launched inside take part in PDL where the device supports it."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def launch_options(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel whose tensors live on t's device: `PDL` (the constexpr
    that compiles `await_inputs` in) and Triton's `launch_pdl`, or `PDL=False` alone."""
    if _enabled and t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if _supports_pdl(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before, then release the next."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
