"""Packed weights in memory the OS may back with 2 MB pages.

Why: a CPU forward at a step's few rows streams every weight from memory once. In 4 KB pages
each page is a TLB miss (a two-dimensional walk inside a virtual machine) and the hardware
prefetchers stop at every page's end; in 2 MB pages neither happens once per 4 KB. A layer's
matrices are far smaller than 2 MB, so each is copied into a shared region, in the order the
model packs them (the order its forward reads them), that is asked for huge pages before it is
first touched (docs/decisions/huge-pages.md). Where the OS gives none (another OS, transparent
huge pages off) the region is ordinary memory: the same bytes, the same results.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
REGION = 32 << 20  # each region's size; a tensor larger than this gets one of its own
ALIGNMENT = 64  # a cache line: every kernel reads its weights in whole lines
SMALLEST = 64 << 10  # below this a tensor stays where torch put it (biases, tiny test models)


class _Regions:
    """Hands out consecutive pieces of regions; a region lives while any tensor in it does."""

    def __init__(self):
        self._lock = threading.Lock()
        self._region: mmap.mmap | None = None
        self._next = self._end = 0

    def _new_region(self, nbytes: int) -> None:
        size = -(-max(nbytes, REGION) // HUGE_PAGE) * HUGE_PAGE
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE  # a multiple of 4 KB
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                region.madvise(mmap.MADV_HUGEPAGE, start, size)
            except OSError:
                pass  # no transparent huge pages here: ordinary pages
        self._region, self._next, self._end = region, start, start + size

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            offset = -(-self._next // ALIGNMENT) * ALIGNMENT
            if self._region is None or offset + nbytes > self._end:
                self._new_region(nbytes)
                offset = self._next
            self._next = offset + nbytes
            piece = torch.frombuffer(self._region, dtype=torch.uint8, offset=offset, count=nbytes)
        placed = piece.view(tensor.dtype).view(tensor.shape)
        placed.copy_(tensor)
        return placed


_REGIONS = _Regions()


def place(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, on the CPU) copied into the packed weights' regions, or itself where
    it is small."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() * tensor.element_size() < SMALLEST:
        return tensor
    return _REGIONS.place(tensor)
