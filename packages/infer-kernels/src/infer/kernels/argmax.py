"""Argmax over the last dim of a batch of logits rows: greedy decoding's choice of token.

`torch.argmax` of one row reduces it in few thread blocks: on an H100 one row of Llama 3's
128,256 fp32 logits took 27.1 µs, more than a layer's attention, and rows of Qwen 3's 151,936 or
Gemma 3's 262,144 9.3 µs (kernels-bench/bench_gated_gemv.py). Here it takes two kernels, 4.1-4.5
µs for those rows. The first gives each chunk of `_BLOCK` entries of a row to its own program
(a row of 128,256 is 126 programs), which writes the chunk's max and its index; the second
reduces one row's chunks in one program.

At 256 rows torch's own reduction was as fast or faster (it has rows enough to fill the GPU):
`argmax` hands batches of more than `MAX_ROWS` rows to it.

Same answer as `torch.argmax`: the first index among equal maxima; a NaN counts as larger than
everything, so the first NaN of a row wins (what torch does on CUDA and CPU).
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, use_triton
from infer.kernels.pdl import await_inputs, launch_options

# Rows up to which the two kernels run: at 64 rows they beat torch.argmax on an H100 on all four
# vocabularies measured (49,152 to 262,144), at 256 they did not
# (docs/benchmarks/generation.md#elsewhere).
MAX_ROWS = 64
# Entries per program of the first pass: 8 fp32 per thread with 4 warps (two 16-byte loads).
_BLOCK = 1024
_NUM_WARPS = 4
# Stands for "no NaN in this chunk" among index values (past any row's last index).
_NO_NAN = 2**62


@triton.jit
def _chunk_argmax_kernel(
    x_ptr,
    x_row_stride,
    max_ptr,
    index_ptr,
    nan_ptr,
    num_cols,
    num_chunks,
    BLOCK: tl.constexpr,
    NO_NAN: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # The chunk's first NaN (tl.max's comparisons skip NaNs), or NO_NAN.
    first_nan = tl.min(tl.where(x != x, cols.to(tl.int64), NO_NAN), axis=0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, value)
    tl.store(index_ptr + out, chunk * BLOCK + index.to(tl.int64))
    tl.store(nan_ptr + out, first_nan)


@triton.jit
def _row_argmax_kernel(
    max_ptr,
    index_ptr,
    nan_ptr,
    out_ptr,
    num_chunks,
    CHUNKS: tl.constexpr,
    NO_NAN: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < num_chunks
    values = tl.load(max_ptr + row * num_chunks + chunks, mask=mask, other=-float("inf"))
    indices = tl.load(index_ptr + row * num_chunks + chunks, mask=mask, other=NO_NAN)
    # Chunks are in column order, so the first chunk holding the max holds its first index.
    best, best_chunk = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # A row of -inf alone: every chunk's max is -inf at its first column, and chunk 0 holds index 0.
    best_index = tl.sum(tl.where(chunks == best_chunk, indices, 0), axis=0)
    first_nan = tl.min(tl.load(nan_ptr + row * num_chunks + chunks, mask=mask, other=NO_NAN), axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < NO_NAN, first_nan, best_index))


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def argmax(logits: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """The index of the largest entry of each row of `logits` `[..., V]`, int64 `[...]`:
    `torch.argmax(logits, dim=-1)`, ties and NaNs included. `pdl`: launch with programmatic
    dependent launch (infer.kernels.pdl)."""
    check_dtype("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last dim, got shape {list(logits.shape)}")
    num_cols = logits.shape[-1]
    if not use_triton(logits) or logits.numel() > MAX_ROWS * num_cols:
        return argmax_ref(logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # read only: a copy changes nothing the caller sees
    rows = logits.reshape(-1, num_cols)
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out.view(logits.shape[:-1])
    num_chunks = triton.cdiv(num_cols, _BLOCK)
    chunk_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty((num_rows, num_chunks), dtype=torch.int64, device=logits.device)
    chunk_nan = torch.empty((num_rows, num_chunks), dtype=torch.int64, device=logits.device)
    options = launch_options(rows, pdl)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        rows,
        rows.stride(0),
        chunk_max,
        chunk_index,
        chunk_nan,
        num_cols,
        num_chunks,
        BLOCK=_BLOCK,
        NO_NAN=_NO_NAN,
        num_warps=_NUM_WARPS,
        **options,
    )
    _row_argmax_kernel[(num_rows,)](
        chunk_max,
        chunk_index,
        chunk_nan,
        out,
        num_chunks,
        CHUNKS=triton.next_power_of_2(num_chunks),
        NO_NAN=_NO_NAN,
        num_warps=4,
        **options,
    )
    return out.view(logits.shape[:-1])
