"""Drafting ahead: the next step's drafts, made while the target verifies this step's.

A step is draft → verify, one after the other: at batch 1 the draft's core idles while the target
verifies, and the target's while the draft proposes (with its RPC, 5-6 ms of a 30 ms step on a
2-core CPU). Here the draft uses the verify's time to guess its outcome. The target will keep j of
the chain's drafts d_1..d_n and then emit its own token t: after d_j where it rejects d_{j+1}
(so t is not d_{j+1}), or after d_n where it keeps them all. For every j the draft takes its own
likeliest tokens at that position (other than d_{j+1}) as guesses for t, and drafts k tokens after
each guess, all guesses in one batch. Where the verdict matches a guess, the coordinator has the
next step's drafts when the verdict comes and skips that step's Propose.

Exact whatever the guesses: drafts are only proposals, and the target verifies them as any.

A draft that reads target features has no target features yet for the chain (the target computes
them in the verify this runs beside): the chain and the guesses are fed with the draft's own
predicted features, as its drafts past the first always are. Only the sequence's tokens (those
sent, with the target's features) are kept in its cache; each guess drafts on a fork of the
sequence (its cache and the chain's columns up to the guess), and the forks are released before
the call returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.speculation import MAX_GUESSES, MAX_K

from .proposer import ProposeItem, propose


@dataclass
class AheadItem:
    seq: SequenceInput  # tokens: those the draft has not cached yet, ending with the history's last
    chain: list[int]  # the drafts the target is verifying now
    guesses: int  # tokens guessed as the target's at each position, besides the chain's own
    k: int  # tokens to draft after each guess


@dataclass
class Guess:
    accepted: int  # drafts of the chain it keeps
    next_token: int  # the target's token it assumes after them
    tokens: list[int]  # the drafts for the step after


def _check(item: AheadItem) -> None:
    name = item.seq.seq_id
    if not item.chain:
        raise InvalidRequest(f"sequence {name!r}: drafting ahead needs the chain being verified")
    if not 1 <= item.k <= MAX_K:
        raise InvalidRequest(f"sequence {name!r}: k must be in [1, {MAX_K}] (got {item.k})")
    if not 1 <= item.guesses <= MAX_GUESSES:
        raise InvalidRequest(f"sequence {name!r}: guesses must be in [1, {MAX_GUESSES}] (got {item.guesses})")


def propose_ahead(engine: Engine, items: list[AheadItem]) -> list[list[Guess]]:
    """For each item, its guesses at the verdict on its chain and the drafts after each (see the
    module docstring). Feeds and keeps each sequence's tokens as a Propose would."""
    for item in items:
        _check(item)
    if engine.feature_size not in (0, engine.hidden_size):
        raise InvalidRequest("drafting ahead needs a draft that reads no target features or hidden-sized ones "
                             "(it feeds its own hidden states in their place)")
    longest = max(len(item.chain) for item in items)
    batch = engine.start([item.seq for item in items], decode_steps=longest, create=True,
                         extra_tokens=[len(item.chain) + item.k for item in items])
    to_token = engine.output_token_ids  # a head over a token subset: column -> token id
    reads_features = bool(engine.feature_size)
    most = max(item.guesses for item in items) + 1  # a position's guesses, and maybe the chain's own token

    def ranked(logits: torch.Tensor) -> list[list[int]]:
        columns = logits.topk(min(most, logits.shape[-1]), dim=-1).indices
        return (columns if to_token is None else to_token[columns]).tolist()

    # The chain pass: at each position 0..n, the draft's ranked tokens and its hidden state (the
    # feature the next position reads). Shorter chains ride along on their last token.
    candidates = [ranked(batch.prefill(1)[:, -1])]
    hidden = [batch.last_hidden()[:, -1] if reads_features else None]
    for step in range(longest):
        tokens = torch.tensor([item.chain[min(step, len(item.chain) - 1)] for item in items], device=engine.device)
        candidates.append(ranked(batch.decode(tokens, hidden[-1])))
        hidden.append(batch.last_hidden()[:, -1] if reads_features else None)
    batch.commit([len(item.seq.tokens) for item in items])

    forks, guesses, ids = [], [], []
    rows = batch.item_rows()  # item i's row in the batch's cache
    try:
        for i, item in enumerate(items):
            base = item.seq.keep_len + len(item.seq.tokens)  # the sequence's columns, then the chain's
            for j in range(len(item.chain) + 1):
                own = item.chain[j] if j < len(item.chain) else None
                for t in [token for token in candidates[j][i] if token != own][: item.guesses]:
                    if len(engine.sequences) >= engine.max_sequences:
                        break  # no room for more forks: fewer guesses, nothing refused
                    fork_id = f"{item.seq.seq_id}\0ahead{len(forks)}"
                    engine.fork(fork_id, batch.kv[:, :, rows[i]], base + j)
                    ids.append(fork_id)
                    features = hidden[j][i][None] if reads_features else None
                    forks.append(ProposeItem(SequenceInput(fork_id, base + j, [t], features), item.k))
                    guesses.append((i, j, t))
        drafted = propose(engine, forks) if forks else []
    finally:
        engine.release(ids)
    results: list[list[Guess]] = [[] for _ in items]
    for (i, j, t), tokens in zip(guesses, drafted):
        results[i].append(Guess(j, t, tokens))
    return results
