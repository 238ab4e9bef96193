"""Masks the logits of tokens a grammar does not allow: -inf where a row's bitmask bit is 0.

A bitmask row packs one bit per token id into int32 words, least significant bit first: token
`t` is allowed when bit `t % 32` of word `t // 32` is set (the layout xgrammar and llguidance
fill). `rows[i]` names the logits row that bitmask row i constrains, so a batch where a few
requests follow a grammar masks only those. Tokens past the bitmask's last word (a model whose
logits are wider than its tokenizer's vocabulary) are not allowed. One program masks a block of
one row's logits; the row indices are read on the device (no host sync).
"""

import torch
import triton
import triton.language as tl

from infer.kernels._dispatch import check_dtype, check_same_device, use_triton
from infer.kernels.pdl import await_inputs, launch_options

# Logits per program: 32 words of the bitmask.
_BLOCK = 1024


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    logits_stride,
    bitmask_stride,
    vocab_size,
    num_words,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tokens // 32
    word = tl.load(bitmask_ptr + row * bitmask_stride + words, mask=in_vocab & (words < num_words), other=0)
    blocked = ((word >> (tokens % 32)) & 1) == 0
    logits_row = tl.load(rows_ptr + row).to(tl.int64)
    at = logits_ptr + logits_row * logits_stride + tokens
    tl.store(at, tl.full([BLOCK], float("-inf"), tl.float32), mask=in_vocab & blocked)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The reference: unpack the bits to a bool mask, then masked_fill the rows."""
    vocab_size = logits.shape[1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], -torch.inf)


def _check(logits, bitmask, rows) -> None:
    check_dtype("logits", logits)
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with unit stride over V, got {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [R, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.shape != (bitmask.shape[0],) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rows must be an int64 (or int32) tensor of shape ({bitmask.shape[0]},), "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, *, pdl: bool = False
) -> None:
    """Sets `logits[rows[i], t]` to -inf, in place, for every token t that bitmask row i does not
    allow. logits [B, V] float; bitmask [R, words] int32; rows [R] distinct row indices in 0..B-1
    (read on the device, so not checked). `pdl`: launch with programmatic dependent launch
    (infer.kernels.pdl)."""
    _check(logits, bitmask, rows)
    if not use_triton(logits):
        apply_token_bitmask_ref(logits, bitmask, rows)
        return
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    if num_rows and vocab_size:
        bitmask = bitmask.contiguous()
        _apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
            logits,
            bitmask,
            rows.contiguous(),
            logits.stride(0),
            bitmask.stride(0),
            vocab_size,
            bitmask.shape[1],
            BLOCK=_BLOCK,
            num_warps=4,
            **launch_options(logits, pdl),
        )
