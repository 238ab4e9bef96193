"""A CPU model's weights in transparent huge pages.

A CPU decode step streams every weight once, so it runs at the speed memory is read. Read through
4 KB pages, each page the stream enters costs a TLB miss and a page walk; through 2 MB pages,
one in 512 does. Linux backs an anonymous mapping with 2 MB pages where the mapping is advised so
(madvise(MADV_HUGEPAGE)) in its "madvise" mode (the CI-class VM's), and everywhere in "always";
torch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE is set). On the 2-core VM a SmolLM2
token's bf16 products ran 1-4% faster from huge pages, pass by pass
(docs/benchmarks/quantization.md#cpu-weights-in-transparent-huge-pages).

`move_to_huge_pages(model)` copies the model's parameters and buffers (the contiguous ones on the
CPU) into one private anonymous mapping so advised, one after another, and points the modules at
the copies; each old storage goes once nothing else holds it, so the peak while moving is about
the model plus its largest tensor. Each copy is a storage of its own bytes over the mapping (which
lives while any of them does), so memory accounting by storage counts what it did. A tensor that
two modules share (a tied embedding and LM head) moves once and stays shared; one already moved (a
model that a second engine is built over) stays where it is.
"""

import logging
import mmap
import platform
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
ALIGNMENT = 64  # a cache line: each tensor starts on one
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Set on each tensor moved here, which keeps it through `.data` assignments.
MOVED = "_in_huge_pages"


def huge_pages_unavailable() -> str | None:
    """Why weights cannot be put in transparent huge pages here, or None where they can."""
    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are Linux's, not {platform.system()}'s"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return f"{THP_MODE} cannot be read"
    if "[never]" in mode:
        return f"transparent huge pages are off ({THP_MODE}: {mode.strip()})"
    return None


def move_to_huge_pages(model: nn.Module) -> int:
    """Moves `model`'s contiguous CPU parameters and buffers into transparent huge pages (module
    doc), in place; returns the bytes moved (0 where `huge_pages_unavailable()`)."""
    reason = huge_pages_unavailable()
    if reason is not None:
        logger.info("the weights stay in 4 KB pages: %s", reason)
        return 0
    # Each tensor once, however many modules hold it: keyed by where it is and what it holds.
    # Only offsets are kept here, so that each old storage can go once its copy is made.
    offsets, size = {}, 0
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if _movable(tensor) and _key(tensor) not in offsets:
                offsets[_key(tensor)] = size
                size += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    if not offsets:
        return 0
    # One huge page more than needed, so that the tensors can start on a huge page's boundary.
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    copies: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            key = _key(tensor) if _movable(tensor) else None
            if key not in offsets:
                continue
            if key not in copies:
                nbytes = tensor.numel() * tensor.element_size()
                # A storage of its own over the mapping, which it keeps alive.
                copy = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start + offsets[key])
                copies[key] = copy.view(tensor.dtype).view(tensor.shape).copy_(tensor.data)
            # In place, so that whoever holds this tensor (a tied module, a method) sees the copy.
            tensor.data = copies[key]
            setattr(tensor, MOVED, True)
    logger.info("%.1f MB of weights in transparent huge pages", size / 1e6)
    return size


def _key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)


def _movable(tensor: torch.Tensor | None) -> bool:
    return (
        tensor is not None
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel() > 0
        and not getattr(tensor, MOVED, False)
    )
