"""The shapes captured steps run at: buckets of batch size x tokens per row x attended columns,
powers of two up to the pool's, and the capture modes (``specbatch.engine.captured``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.config.options import CUDA_GRAPH_MODES
from specbatch.protocol.speculation import MAX_K

# "auto": "on" for CUDA with the engine's own forward, else "off"; "on": CUDA graphs captured at
# start-up; "lazy": captured at a bucket's first use; "static": the padded static path, eager (no
# capture; any device); "off": the plain eager forward.
MODES = CUDA_GRAPH_MODES


SMALLEST_CONTEXT = 64


def _powers(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from ``smallest``, the last the first one reaching ``largest``, capped at it."""
    sizes, size = [], smallest
    while True:
        sizes.append(min(size, largest))
        if size >= largest:
            return tuple(sizes)
        size *= 2


@dataclass(frozen=True)
class Buckets:
    """The static shapes a call is padded to: rows, tokens per row, attended columns."""

    batch: tuple[int, ...]
    width: tuple[int, ...]
    context: tuple[int, ...]

    @classmethod
    def for_pool(cls, slots: int, context: int, max_width: int = MAX_K + 1) -> "Buckets":
        """Batch sizes 1, 2, 4 … up to the pool's slots; widths 1, 2, 4 … up to MAX_K + 1 (verifying
        MAX_K drafts); attended columns 64, 128 … up to the longest a row reaches (the pool's
        columns less the scratch column)."""
        return cls(_powers(1, slots), _powers(1, max_width), _powers(min(SMALLEST_CONTEXT, context - 1), context - 1))

    def bucket_for(self, batch: int, width: int, end: int) -> tuple[int, int, int] | None:
        """The smallest bucket that fits, or None when one of the sizes is past every bucket."""
        fits = [next((size for size in sizes if size >= need), None)
                for sizes, need in ((self.batch, batch), (self.width, width), (self.context, end))]
        return None if None in fits else tuple(fits)

    def all(self) -> list[tuple[int, int, int]]:
        """Every bucket, largest first (the order of capture)."""
        return sorted(((b, w, e) for b in self.batch for w in self.width for e in self.context), reverse=True)


def resolve_mode(mode: str, device: torch.device, own_forward: bool) -> str:
    """The mode an engine runs: "auto" is "on" for CUDA with the engine's own forward (the
    transformers forward builds cache objects and masks on the host), else "off"."""
    if mode not in MODES:
        raise ValueError(f"captured steps: unknown mode {mode!r} (one of {', '.join(MODES)})")
    if mode == "auto":
        return "on" if device.type == "cuda" and own_forward else "off"
    return mode
