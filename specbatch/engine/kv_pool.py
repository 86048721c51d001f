"""The KV pool of an engine: the keys and values of all its sequences, a slot each, kept across
calls (see ``specbatch.engine.engine``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specbatch.protocol.errors import CapacityExceeded


def write_columns_and_mask(positions: torch.Tensor, valid: torch.Tensor, scratch: int,
                           end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a call's tokens write their keys/values, and the 4D mask of what each may attend,
    ``[batch, 1, width, end]``: a real token writes at its position and sees its row's columns up
    to itself; a padding token writes to the ``scratch`` column and sees column 0 only (which
    keeps it finite). On the device of ``positions``."""
    if positions.device.type == "cpu":
        # The same in numpy: a step's few host values, where each of torch's ops costs its dispatch
        # (several times numpy's), and a one-token step's Python is a share of its time.
        p, v = positions.numpy(), valid.numpy()
        seen = np.arange(end)
        mask = np.where(v[:, :, None], seen <= p[:, :, None], seen == 0)[:, None]
        return torch.from_numpy(np.where(v, p, scratch)), torch.from_numpy(mask)
    columns = torch.where(valid, positions, torch.full_like(positions, scratch))
    seen = torch.arange(end, device=positions.device)[None, None, :]
    mask = torch.where(valid[:, :, None], seen <= positions[:, :, None], seen == 0)[:, None]
    return columns, mask


def _fed_columns(columns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each fed token's column, for every token of its row, ``[batch, width, width]`` (padding: 0)."""
    batch, width = columns.shape
    return torch.where(valid, columns, torch.zeros_like(columns))[:, None, :].expand(batch, width, width)


def fed_visibility(mask: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Which fed tokens each token sees under ``mask``: ``[batch, width, width]``, read at the fed
    tokens' write ``columns`` (padding reads column 0). ``tree_mask`` puts it back."""
    return mask[:, 0].gather(2, _fed_columns(columns, valid))


def tree_mask(mask: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
    """A chain's mask (from ``write_columns_and_mask``: every token sees its row's columns up to its
    own) with the fed tokens a tree token does not descend from taken out: ``sees[b, t, w]``, whether
    fed token t sees fed token w, right-aligned like the tokens. Fixed shapes and no host sync (a
    captured step runs it). For a chain, ``sees`` is lower-triangular and nothing changes."""
    at = _fed_columns(columns, valid)
    chain = mask[:, 0].gather(2, at)  # what the chain's mask says at each fed token's column
    # Padding (either side) keeps the chain's value, so every write to a shared column 0 agrees.
    value = torch.where(valid[:, :, None] & valid[:, None, :], sees, chain)
    return mask[:, 0].scatter(2, at, value)[:, None]


class KVPool:
    """Keys and values of every sequence of an engine, one slot per sequence.

    Grows by doubling (slots or context columns) with a copy, so growing is rare; the last column
    of every slot is scratch for padding tokens and is never part of a sequence. A fixed pool
    (``fix``: captured steps need its address to stay) is allocated once and never grows.
    """

    def __init__(self, kv_shape: tuple[int, int, int], dtype, device, max_bytes: int | None):
        self.layers, self.kv_heads, self.head_dim = kv_shape
        self.dtype, self.device, self.max_bytes = dtype, device, max_bytes
        self.kv = self._zeros(0, 0)
        self.fixed = False

    def fix(self, slots: int, context: int) -> None:
        """Allocate the pool once, ``context`` columns (scratch included) for as many of ``slots``
        slots as the budget holds, and refuse to grow from then on."""
        if self.max_bytes is not None:
            slots = min(slots, self.max_bytes // self.bytes_for(1, context))
        if slots < 1:
            raise CapacityExceeded(f"a KV budget of {self.max_bytes / 2**20:.2f} MiB holds no sequence of "
                                   f"{context - 1} tokens ({self.bytes_for(1, context) / 2**20:.2f} MiB)")
        self.kv = self._zeros(slots, context)
        self.fixed = True

    def _zeros(self, slots: int, context: int) -> torch.Tensor:
        # Zeros, not empty: masked columns still enter the attention product as `0 * value`,
        # and a NaN from uninitialised memory would survive that.
        return torch.zeros(self.layers, 2, slots, self.kv_heads, context, self.head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @property
    def context(self) -> int:
        return self.kv.shape[4]

    def bytes_for(self, slots: int, context: int) -> int:
        return self.layers * 2 * slots * self.kv_heads * context * self.head_dim * self.kv.element_size()

    def ensure(self, slots: int, context: int, context_limit: int) -> None:
        """Make room for ``slots`` slots of ``context`` columns (the scratch column included).

        Live sequences always hold the slots below ``slots`` (slots are kept dense), so a
        reallocation may drop the slots above it, never a live column.
        """
        if slots <= self.slots and context <= self.context:
            return
        if self.fixed:
            raise CapacityExceeded(
                f"the KV pool is allocated once at {self.slots} sequences of up to {self.context - 1} tokens "
                f"(captured steps keep it in place); {slots} sequences of up to {context - 1} tokens do not fit")
        doubled = (max(slots, 2 * self.slots, 8) if slots > self.slots else self.slots,
                   min(max(context, 2 * self.context, 64), context_limit) if context > self.context else self.context)
        exact = (slots, max(context, self.context))
        for new_slots, new_context in (doubled, exact):
            if self.max_bytes is None or self.bytes_for(new_slots, new_context) <= self.max_bytes:
                break
        else:
            raise CapacityExceeded(
                f"the KV cache would need {self.bytes_for(*exact) / 2**20:.2f} MiB for {slots} sequences of up to "
                f"{context - 1} tokens; its budget is {self.max_bytes / 2**20:.2f} MiB"
            )
        kv = self._zeros(new_slots, new_context)
        keep = min(self.slots, new_slots)
        kv[:, :, :keep, :, : self.context] = self.kv[:, :, :keep]
        self.kv = kv

    def move(self, source: int, target: int, length: int) -> None:
        self.kv[:, :, target, :, :length] = self.kv[:, :, source, :, :length]


@dataclass
class SequenceCache:
    """One sequence's place in the pool: its slot and how many of its columns are valid."""

    pool: KVPool
    slot: int
    length: int = 0
    last_used: float = 0.0  # the engine's clock at the last call that touched it (its lease)

    @property
    def kv(self) -> torch.Tensor:
        """This sequence's keys/values, ``[layers, 2, kv_heads, context, head_dim]`` (a view)."""
        return self.pool.kv[:, :, self.slot]
