"""The draft side of a step: propose k tokens for every sequence of a batch in one batched loop."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.engine.sampling import (
    DRAW_DRAFT,
    MAX_SUPPORT,
    SamplingParams,
    SparseDistribution,
    distributions,
    params_tensors,
    sample,
    uniforms,
)
from specbatch.kernels.layers import argmax
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.speculation import MAX_K, MAX_LEAVES

# How many of its most likely tokens the draft samples among, for a sampled request: q' is q cut
# to them. Exact whatever the size (the target is told q'); larger keeps more of q's tail, which
# only matters where the target would also have drawn from it. 32 tokens cost about 200 bytes per
# drafted position on the wire (docs/speculation.md).
SUPPORT_SIZE = 32


@dataclass
class ProposeItem:
    seq: SequenceInput  # tokens: those the draft has not cached yet, ending with the last accepted one
    k: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # How many leaves to propose at each of the first drafted positions (none past the list).
    leaves: list[int] = field(default_factory=list)


@dataclass
class Proposal:
    tokens: list[int]
    # Sampled requests: the q' each token was drawn from, one per token. Greedy: none.
    distributions: list[SparseDistribution] = field(default_factory=list)
    # Leaves: at drafted position j, the draft's next most likely tokens after tokens[j] (by its
    # logits, before any sampling cut), as many as asked.
    leaves: list[list[int]] = field(default_factory=list)


def propose(engine: Engine, items: list[ProposeItem]) -> list[list[int]]:
    """The proposed tokens alone (see ``proposals``)."""
    return [proposal.tokens for proposal in proposals(engine, items)]


def check(items: list[ProposeItem]) -> None:
    """Refuse a call with an item that is wrong whatever the draft holds: k, leaves, sampling."""
    for item in items:
        if not 1 <= item.k <= MAX_K:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: k must be in [1, {MAX_K}] (got {item.k})")
        if len(item.leaves) > item.k or not all(0 <= n <= MAX_LEAVES for n in item.leaves):
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: leaves at {len(item.leaves)} positions for k = "
                                 f"{item.k}, each 0 to {MAX_LEAVES} (got {list(item.leaves)[:MAX_K + 1]})")
        problems = item.sampling.problems()
        if problems:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: " + "; ".join(problems))


def proposals(engine: Engine, items: list[ProposeItem], support_size: int = SUPPORT_SIZE) -> list[Proposal]:
    """k-token proposals, one forward per drafted position for the whole batch (on the CPU
    kernels, a greedy call's forwards in one C call: ``RaggedBatch.greedy_chain``).

    Greedy requests get the draft's argmax at each position. Sampled requests draw from q': the
    draft's distribution under the request's own temperature/top-k/top-p, cut to its
    ``support_size`` most likely tokens; the draw at each position is seeded by (seed, position),
    so it is the same in any batch.

    The first forward takes each sequence's uncached tokens (ragged); the next k-1 feed back the
    token just drafted. Rows with a smaller k ride along and their extra tokens are dropped. A
    plain draft keeps the keys/values of what it was fed, so its cache ends k-1 tokens past its
    history: the coordinator rolls it back to the accepted length on the next call. A draft that
    reads target features feeds its drafted tokens with its own predicted features, so it keeps
    only the tokens it was sent (with the target's true features); accepted drafts come back next
    step with theirs. Sequences feeding very different token counts (a new sequence's prompt
    beside others' last tokens) draft in separate forwards (``Engine.by_length``). A
    sequence sent with keep_len 0 is created, so a restarted draft is rebuilt
    from the caller's history.
    """
    if not 1 <= support_size <= MAX_SUPPORT:
        raise ValueError(f"support_size must be in [1, {MAX_SUPPORT}] (got {support_size})")
    check(items)
    extra_tokens = [item.k - 1 for item in items]
    caught_up = engine.catch_up([item.seq for item in items], extra_tokens)  # captured steps: wide rows first
    items = [item if seq is item.seq else replace(item, seq=seq) for item, seq in zip(items, caught_up)]
    split = engine.by_length([item.seq for item in items], True,  # a new prompt beside others' last tokens
                             lambda group: proposals(engine, [items[i] for i in group], support_size), extra_tokens)
    if split is not None:
        return split
    steps = max(item.k for item in items) - 1
    batch = engine.start([item.seq for item in items], decode_steps=steps, create=True, extra_tokens=extra_tokens)
    to_token = engine.output_token_ids  # a head over a token subset: column -> token id
    reads_features = bool(engine.feature_size)

    sampled = [i for i, item in enumerate(items) if not item.sampling.greedy]
    if sampled:
        params = [items[i].sampling for i in sampled]
        temperature, top_k, top_p = params_tensors(params)
        first = [len(items[i].seq.tokens) + items[i].seq.keep_len for i in sampled]
        draft_u = uniforms([p.seed for p in params], [[f + j for j in range(steps + 1)] for f in first], DRAW_DRAFT)
        sampled_rows = torch.tensor(sampled)
    supports = []  # per drafted position: ([S, N] columns, [S, N] probabilities) of the sampled rows

    everyone = len(sampled) == len(items)  # then no argmax, and no copy of the sampled rows
    # Leaves: per drafted position, the most any row asks for, and the draft's ranked columns there.
    most_leaves = [max(item.leaves[step] if step < len(item.leaves) else 0 for item in items)
                   for step in range(steps + 1)]
    ranked = {}

    def pick(logits: torch.Tensor, step: int) -> torch.Tensor:
        if most_leaves[step]:  # the drafted token and the leaves are among these
            ranked[step] = logits.topk(min(most_leaves[step] + 1, logits.shape[-1]), dim=-1).indices
        columns = torch.empty(len(items), dtype=torch.long, device=logits.device) if everyone else argmax(logits)
        if sampled:
            q = distributions(logits if everyone else logits[sampled_rows], temperature, top_k, top_p)
            top, support = torch.topk(q.kept(), min(support_size, logits.shape[-1]), dim=-1)
            probs = (top - q.log_norm).exp()  # q of each support token; 0 for tokens the cuts removed
            columns[sampled_rows] = support.gather(-1, sample(probs, draft_u[:, step])[:, None]).view(-1)
            supports.append((support, probs))
        return columns if to_token is None else to_token[columns]

    # Greedy rows, leaves at the first position at most (batch 1's usual step): the whole loop below
    # in one C call, where the forward has it: the same tokens without a Python round per drafted
    # token, and the first position's logits to rank where leaves are asked.
    chain = None if sampled or any(most_leaves[1:]) else batch.greedy_chain(steps, to_token, bool(most_leaves[0]))
    if chain is not None:
        table = chain[0]
        if most_leaves[0]:
            ranked[0] = chain[1].topk(min(most_leaves[0] + 1, chain[1].shape[-1]), dim=-1).indices
    else:
        tokens = pick(batch.prefill(1)[:, -1], 0)
        drafted = [tokens]
        for step in range(steps):
            features = batch.last_hidden()[:, -1] if reads_features else None
            tokens = pick(batch.decode(tokens, features), step + 1)
            drafted.append(tokens)
        table = torch.stack(drafted, dim=1).tolist()
    batch.commit([len(item.seq.tokens) + (0 if reads_features else min(item.k - 1, steps)) for item in items])
    results = [Proposal(row[: item.k]) for row, item in zip(table, items)]
    ranked = {step: (columns if to_token is None else to_token[columns]).tolist() for step, columns in ranked.items()}
    for i, item in enumerate(items):
        results[i].leaves = [[token for token in ranked[step][i] if token != table[i][step]][:n] if n else []
                             for step, n in enumerate(item.leaves)]
    if sampled:
        support = torch.stack([s for s, _ in supports], dim=1)  # [S, steps + 1, N], most likely first
        if to_token is not None:
            support = to_token[support]
        probs = torch.stack([p for _, p in supports], dim=1)
        sizes = (probs > 0).sum(-1).tolist()  # the cuts' zeros come last
        support, probs = support.cpu().numpy(), probs.cpu().numpy()
        for row, i in enumerate(sampled):
            results[i].distributions = [SparseDistribution(support[row, step, :n], probs[row, step, :n])
                                        for step, n in enumerate(sizes[row][: len(results[i].tokens)])]
    return results
