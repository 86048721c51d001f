"""The target side of a step: verify a batch of drafts in one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbatch.acceptance import accept
from specbatch.engine import Engine, InvalidRequest, SequenceInput
from specbatch.sampling import SamplingParams


@dataclass
class VerifyItem:
    seq: SequenceInput  # tokens: those the target has not cached yet, ending with the last accepted one
    drafts: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Verdict:
    accepted: int  # how many of the drafts the target keeps
    next_token: int  # the target's token after the accepted drafts
    cached_len: int  # tokens of this sequence now cached on the target
    # With return_features: the target's final hidden state at each token it fed and kept
    # ([kept, hidden]), for a draft that reads them (specbatch.eagle).
    features: torch.Tensor | None = None


def verify(engine: Engine, items: list[VerifyItem], create: bool = False,
           return_features: bool = False) -> list[Verdict]:
    """One forward of (uncached tokens + drafts) for every sequence, then the acceptance rule.

    With no drafts this is a prefill that also yields the first token. The target keeps the
    keys/values of the accepted drafts only; the next token is not fed yet (it is the next
    step's first input).
    """
    for item in items:
        problems = item.sampling.problems()
        if not item.sampling.greedy and item.drafts:
            problems.append("sampled requests are verified without drafts until rejection sampling lands")
        if problems:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: " + "; ".join(problems))
    fed = [SequenceInput(i.seq.seq_id, i.seq.keep_len, i.seq.tokens + i.drafts) for i in items]
    batch = engine.start(fed, create=create)
    width = max(len(i.drafts) for i in items) + 1
    logits = batch.prefill(width)
    decisions = []
    for row, item in enumerate(items):
        positions = len(item.drafts) + 1
        first_position = item.seq.keep_len + len(item.seq.tokens)
        decisions.append(accept(logits[row, width - positions :], item.drafts, item.sampling, first_position))
    keep = [len(item.seq.tokens) + accepted for item, (accepted, _) in zip(items, decisions)]
    batch.commit(keep)
    features = [None] * len(items)
    if return_features:
        hidden = batch.last_hidden()
        columns = hidden.shape[1]
        for row, item in enumerate(items):
            first = columns - len(item.seq.tokens) - len(item.drafts)  # right-aligned
            features[row] = hidden[row, first : first + keep[row]].to("cpu", torch.float16)
    return [
        Verdict(accepted, token, item.seq.keep_len + kept, feats)
        for item, (accepted, token), kept, feats in zip(items, decisions, keep, features)
    ]
