"""The target side of a step: verify a batch of drafts in one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbatch.acceptance import SampledDrafts, greedy_accept, rejection_sample, sampled_drafts
from specbatch.engine import Engine, InvalidRequest, SequenceInput
from specbatch.sampling import (DRAW_ACCEPT, DRAW_TARGET, SamplingParams, SparseDistribution, distributions,
                                params_tensors, uniforms)


@dataclass
class VerifyItem:
    seq: SequenceInput  # tokens: those the target has not cached yet, ending with the last accepted one
    drafts: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Sampled requests with drafts: the q' each draft token was drawn from, one per draft.
    draft_distributions: list[SparseDistribution] = field(default_factory=list)


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
    """One forward of (uncached tokens + drafts) for every sequence, then the acceptance rule
    (specbatch.acceptance): greedy rows and sampled rows each in one batched decision.

    With no drafts this is a prefill that also yields the first token. The target keeps the
    keys/values of the accepted drafts only; the next token is not fed yet (it is the next
    step's first input).
    """
    for item in items:
        problems = item.sampling.problems()
        if problems:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: " + "; ".join(problems))
    sampled = [i for i, item in enumerate(items) if not item.sampling.greedy]
    # Checked before anything runs, so a malformed q' changes no state.
    drafts_q = sampled_drafts([items[i].seq.seq_id for i in sampled], [items[i].drafts for i in sampled],
                              [items[i].draft_distributions for i in sampled], engine.vocab_size) if sampled else None
    fed = [SequenceInput(i.seq.seq_id, i.seq.keep_len, i.seq.tokens + i.drafts) for i in items]
    batch = engine.start(fed, create=create)
    width = max(len(i.drafts) for i in items) + 1
    logits = batch.prefill(width)  # [batch, width, vocab], right-aligned: item i's last len(drafts)+1 columns
    decisions: list[tuple[int, int]] = [(0, 0)] * len(items)
    greedy = [i for i, item in enumerate(items) if item.sampling.greedy]

    def rows(which: list[int]) -> torch.Tensor:  # no copy of a vocabulary-wide tensor when all rows are meant
        return logits if len(which) == len(items) else logits[which]

    if greedy:
        predicted = rows(greedy).argmax(-1).tolist()
        for i, row in zip(greedy, predicted):
            decisions[i] = greedy_accept(row[width - len(items[i].drafts) - 1 :], items[i].drafts)
    if sampled:
        for i, decision in zip(sampled, _rejection_sample([items[i] for i in sampled], rows(sampled), drafts_q)):
            decisions[i] = decision
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


def _rejection_sample(items: list[VerifyItem], logits: torch.Tensor, drafts: SampledDrafts) -> list[tuple[int, int]]:
    """Speculative sampling for the sampled rows: p at each row's K+1 decided positions (rows with
    fewer drafts repeat their last), seeded uniforms by absolute position, then the rule."""
    width = logits.shape[1]
    k = drafts.tokens.shape[1]
    counts = drafts.counts[:, None]
    if width != k + 1 or bool((counts != k).any()):  # left-align each row's own k+1 positions
        columns = width - counts - 1 + torch.minimum(torch.arange(k + 1)[None, :], counts)
        rows = torch.arange(len(items))[:, None]
        logits = logits[rows.to(logits.device), columns.to(logits.device)]
    temperature, top_k, top_p = (t[:, None].expand(-1, k + 1) for t in params_tensors([i.sampling for i in items]))
    p = distributions(logits, temperature, top_k, top_p)
    seeds = [item.sampling.seed for item in items]
    positions = [[item.seq.keep_len + len(item.seq.tokens) + j for j in range(k + 1)] for item in items]
    accept_u = uniforms(seeds, positions, DRAW_ACCEPT)[:, :k]
    target_u = uniforms(seeds, positions, DRAW_TARGET)
    accepted, next_token = rejection_sample(p, drafts, accept_u, target_u)
    return list(zip(accepted.tolist(), next_token.tolist()))
