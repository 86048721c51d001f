"""The draft side of a step: propose k tokens for every sequence of a batch in one batched loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.engine import Engine, InvalidRequest, SequenceInput

MAX_K = 16


@dataclass
class ProposeItem:
    seq: SequenceInput  # tokens: those the draft has not cached yet, ending with the last accepted one
    k: int


def propose(engine: Engine, items: list[ProposeItem]) -> list[list[int]]:
    """Greedy k-token proposals, one forward per drafted position for the whole batch.

    The first forward takes each sequence's uncached tokens (ragged); the next k-1 feed back the
    token just drafted. Rows with a smaller k ride along and their extra tokens are dropped. Each
    sequence keeps the keys/values of what it was fed, so its cache ends k-1 tokens past its
    history: the coordinator rolls it back to the accepted length on the next call. A sequence
    sent with keep_len 0 is created, so a restarted draft is rebuilt from the caller's history.
    """
    for item in items:
        if not 1 <= item.k <= MAX_K:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: k must be in [1, {MAX_K}] (got {item.k})")
    steps = max(item.k for item in items) - 1
    batch = engine.start([item.seq for item in items], decode_steps=steps, create=True, extra_tokens=[item.k - 1 for item in items])
    tokens = batch.prefill(1)[:, -1].argmax(-1)
    drafted = [tokens]
    for _ in range(steps):
        tokens = batch.decode(tokens).argmax(-1)
        drafted.append(tokens)
    table = torch.stack(drafted, dim=1).tolist()
    batch.commit([len(item.seq.tokens) + item.k - 1 for item in items])
    return [row[: item.k] for row, item in zip(table, items)]
