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
    token just drafted. Rows with a smaller k ride along and their extra tokens are dropped. A
    plain draft keeps the keys/values of what it was fed, so its cache ends k-1 tokens past its
    history: the coordinator rolls it back to the accepted length on the next call. A draft that
    reads target features feeds its drafted tokens with its own predicted features, so it keeps
    only the tokens it was sent (with the target's true features); accepted drafts come back next
    step with theirs. A sequence sent with keep_len 0 is created, so a restarted draft is rebuilt
    from the caller's history.
    """
    for item in items:
        if not 1 <= item.k <= MAX_K:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: k must be in [1, {MAX_K}] (got {item.k})")
    steps = max(item.k for item in items) - 1
    batch = engine.start([item.seq for item in items], decode_steps=steps, create=True, extra_tokens=[item.k - 1 for item in items])
    to_token = engine.output_token_ids  # a head over a token subset: column -> token id
    reads_features = bool(engine.feature_size)

    def pick(logits):
        best = logits.argmax(-1)
        return best if to_token is None else to_token[best]

    tokens = pick(batch.prefill(1)[:, -1])
    drafted = [tokens]
    for _ in range(steps):
        features = batch.last_hidden()[:, -1] if reads_features else None
        tokens = pick(batch.decode(tokens, features))
        drafted.append(tokens)
    table = torch.stack(drafted, dim=1).tolist()
    batch.commit([len(item.seq.tokens) + (0 if reads_features else item.k - 1) for item in items])
    return [row[: item.k] for row, item in zip(table, items)]
