"""The target side of a step: verify a batch of drafts in one forward pass."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from specbatch.engine.acceptance import SampledDrafts, greedy_accept, leaf_hit, rejection_sample, sampled_drafts
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.engine.sampling import (
    DRAW_ACCEPT,
    DRAW_EMULATED,
    DRAW_TARGET,
    SamplingParams,
    SparseDistribution,
    distributions,
    params_tensors,
    sample,
    uniforms,
)
from specbatch.kernels.layers import argmax_list
from specbatch.protocol.emulation import rate_at
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.speculation import FLOAT16_MAX, MAX_K, MAX_LEAVES


@dataclass
class VerifyItem:
    seq: SequenceInput  # tokens: those the target has not cached yet, ending with the last accepted one
    drafts: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Sampled requests with drafts: the q' each draft token was drawn from, one per draft.
    draft_distributions: list[SparseDistribution] = field(default_factory=list)
    # The draft's next-best tokens: leaves[j] are alternatives to drafts[j], each fed beside the
    # chain and seeing it only up to its own position (specbatch.engine.acceptance, "Leaves").
    leaves: list[list[int]] = field(default_factory=list)

    def problems(self) -> list[str]:
        """What is wrong with this item whatever the target holds. Drafts and leaves are bounded
        as the draft service bounds what it proposes: a tree of thousands of leaves would hold
        the model for seconds."""
        problems = self.sampling.problems()
        if len(self.drafts) > MAX_K:
            problems.append(f"{len(self.drafts)} drafts: at most {MAX_K}")
        if len(self.leaves) > len(self.drafts):
            problems.append(f"leaves at {len(self.leaves)} positions for {len(self.drafts)} drafts")
        for j, (draft, at) in enumerate(zip(self.drafts, self.leaves)):
            if len(at) > MAX_LEAVES:
                problems.append(f"{len(at)} leaves at position {j}: at most {MAX_LEAVES}")
            elif len(set(at)) != len(at) or draft in at:
                problems.append(f"the leaves at position {j} repeat a token or the draft's own")
        return problems

    def all_leaves(self) -> list[int]:
        """Every position's leaves in order: as they are fed after the chain, and as ``leaf_hit`` counts them."""
        return [token for at in self.leaves for token in at]

    def taken(self, verdict: "Verdict") -> list[int]:
        """The tokens ``verdict`` gives this item's sequence: the accepted drafts, a kept leaf, then
        the target's next token."""
        return self.drafts[: verdict.accepted] + ([verdict.leaf] if verdict.leaf is not None else []) + [
            verdict.next_token]

    def fed(self) -> SequenceInput:
        """What the target runs: the uncached tokens and the drafts as a chain, each position's
        leaves branching off the token before that position."""
        chain = self.seq.tokens + self.drafts
        if not any(self.leaves):
            return SequenceInput(self.seq.seq_id, self.seq.keep_len, chain)
        parents = list(range(-1, len(chain) - 1))
        for j, at in enumerate(self.leaves):
            parents += [len(self.seq.tokens) - 1 + j] * len(at)
        return SequenceInput(self.seq.seq_id, self.seq.keep_len, chain + self.all_leaves(), parents=parents)


@dataclass
class Verdict:
    accepted: int  # how many of the drafts the target keeps
    next_token: int  # the target's token after the accepted drafts
    cached_len: int  # tokens of this sequence now cached on the target
    leaf: int | None = None  # the leaf kept after the accepted drafts (next_token follows it)
    # With return_features: the target's final hidden state at each token it fed and kept
    # ([kept, hidden]), for a draft that reads them (specbatch.models.eagle).
    features: torch.Tensor | None = None


def check(items: list[VerifyItem]) -> None:
    """Refuse a call with an item that is wrong whatever the target holds (``VerifyItem.problems``)."""
    for item in items:
        problems = item.problems()
        if problems:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: " + "; ".join(problems))


def verify(engine: Engine, items: list[VerifyItem], create: bool = False,
           return_features: bool = False, emulated: tuple[float, ...] | None = None) -> list[Verdict]:
    """One forward of (uncached tokens + drafts + leaves) for every sequence, then the acceptance
    rule (specbatch.engine.acceptance): greedy rows and sampled rows each in one batched decision.

    With no drafts this is a prefill that also yields the first token. The target keeps the
    keys/values of the accepted drafts (and of a kept leaf) only; the next token is not fed yet
    (it is the next step's first input). Sequences feeding very different token counts (prompts
    of many lengths, a prompt beside a step's chains) run as forwards of similar ones
    (``Engine.by_length``), with the same results.

    ``emulated`` (--emulate-acceptance, for timing only): conditional acceptance rates per draft
    position; how many drafts each row keeps is drawn at them (``_emulated``) instead of decided by
    the rule, so the output is not the target's.
    """
    check(items)
    sampled = [i for i, item in enumerate(items) if not item.sampling.greedy]
    # Checked before anything runs, so a malformed q' changes no state.
    drafts_q = sampled_drafts([items[i].seq.seq_id for i in sampled], [items[i].drafts for i in sampled],
                              [items[i].draft_distributions for i in sampled], engine.vocab_size) if sampled else None
    fed = [item.fed() for item in items]
    split = engine.by_length(fed, create, lambda group: verify(engine, [items[i] for i in group], create,
                                                              return_features, emulated))
    if split is not None:
        return split
    batch = engine.start(fed, create=create)
    leaf_counts = [len(item.all_leaves()) for item in items]
    # Right-aligned: item i's last leaf_counts[i] columns are its leaves, the len(drafts)+1 before
    # them the positions the chain decides.
    width = max(len(item.drafts) + 1 + n for item, n in zip(items, leaf_counts))
    logits = batch.prefill(width)
    decisions: list[tuple[int, int | None, int]] = [(0, None, 0)] * len(items)  # accepted, leaf hit, next token
    greedy = [i for i, item in enumerate(items) if item.sampling.greedy]

    def rows(which: list[int]) -> torch.Tensor:  # no copy of a vocabulary-wide tensor when all rows are meant
        return logits if len(which) == len(items) else logits[which]

    if greedy and emulated is None:
        predicted = argmax_list(rows(greedy))
        for i, row in zip(greedy, predicted):
            item, leaves = items[i], leaf_counts[i]
            accepted, token = greedy_accept(row[width - leaves - len(item.drafts) - 1 : width - leaves], item.drafts)
            hit = leaf_hit(item.leaves, accepted, len(item.drafts), token)
            decisions[i] = (accepted, hit, token if hit is None else row[width - leaves + hit])
    if sampled:
        for i, decision in zip(sampled, _rejection_sample([items[i] for i in sampled], rows(sampled), drafts_q,
                                                          [leaf_counts[i] for i in sampled])):
            decisions[i] = decision
    if emulated is not None:
        # After the rule (a sampled row's rule still runs: its cost is part of a real step), in
        # place of its verdicts. The argmax over every row stands for the greedy rule's.
        decisions = _emulated(items, argmax_list(logits), width, leaf_counts, emulated)
    paths = [_kept_path(item, accepted, hit) for item, (accepted, hit, _) in zip(items, decisions)]
    keep = [len(path) for path in paths]
    batch.commit(keep, paths if any(hit is not None for _, hit, _ in decisions) else None)
    features = [None] * len(items)
    if return_features:
        # On the host at once: one copy from a GPU, not one (and a wait) per row; in float16's
        # range, as they cross the wire (a hosted draft reads what a draft elsewhere would).
        hidden = batch.last_hidden().clamp(-FLOAT16_MAX, FLOAT16_MAX).to("cpu", torch.float16)
        columns = hidden.shape[1]
        for row, (item, path) in enumerate(zip(items, paths)):
            first = columns - len(item.seq.tokens) - len(item.drafts) - leaf_counts[row]  # right-aligned
            kept = hidden[row, first : first + keep[row]] if path[-1] == keep[row] - 1 else \
                hidden[row, [first + index for index in path]]
            features[row] = kept
    return [
        Verdict(accepted, token, item.seq.keep_len + kept, features=feats,
                leaf=None if hit is None else item.all_leaves()[hit])
        for item, (accepted, hit, token), kept, feats in zip(items, decisions, keep, features)
    ]


def _kept_path(item: VerifyItem, accepted: int, hit: int | None) -> list[int]:
    """The fed tokens a sequence keeps, by index: its uncached tokens, the accepted drafts, and
    the kept leaf (leaves follow the chain in what was fed)."""
    path = list(range(len(item.seq.tokens) + accepted))
    if hit is not None:
        path.append(len(item.seq.tokens) + len(item.drafts) + hit)
    return path


def sequence_seed(item: VerifyItem) -> int:
    """The seed of a row's emulated draws: its request's sampling seed (the coordinator gives every
    request one), else a hash of its sequence id, stable across processes and restarts."""
    if item.sampling.seed:
        return item.sampling.seed
    return int.from_bytes(hashlib.blake2b(item.seq.seq_id.encode(), digest_size=8).digest(), "little")


def _emulated(items: list[VerifyItem], predicted: list[list[int]], width: int, leaf_counts: list[int],
              rates: tuple[float, ...]) -> list[tuple[int, int | None, int]]:
    """Emulated acceptance: draft j of a row is kept with probability rate_at(rates, j) given the
    ones before it were, by a uniform seeded by (the row's seed, the draft's absolute position,
    DRAW_EMULATED), so a row's verdict never depends on its batch, a retry or a restart. The next
    token is the target's argmax at the first position not kept (sampled rows too: a simplification,
    timing is the point). No leaf is ever kept: one is kept only where the target's token there is
    a leaf, and emulated drafts say nothing about that. Per row: (accepted, None, next token)."""
    k = max(len(item.drafts) for item in items)
    if k == 0:
        u = [[] for _ in items]
    else:
        positions = [[item.seq.keep_len + len(item.seq.tokens) + j for j in range(k)] for item in items]
        u = uniforms([sequence_seed(item) for item in items], positions, DRAW_EMULATED).tolist()
    decisions = []
    for item, row, draws, leaves in zip(items, predicted, u, leaf_counts):
        accepted = 0
        while accepted < len(item.drafts) and draws[accepted] < rate_at(rates, accepted):
            accepted += 1
        first = width - leaves - len(item.drafts) - 1  # right-aligned: the row's decided positions
        decisions.append((accepted, None, row[first + accepted]))
    return decisions


def _rejection_sample(items: list[VerifyItem], logits: torch.Tensor, drafts: SampledDrafts,
                      leaf_counts: list[int]) -> list[tuple[int, int | None, int]]:
    """Speculative sampling for the sampled rows: p at each row's K+1 decided positions (rows with
    fewer drafts repeat their last), seeded uniforms by absolute position, then the rule; where
    the token drawn at a rejected position is one of its leaves, the token after it is drawn from
    p at that leaf, with the uniform of the position after it. Per row: (accepted, leaf hit, next
    token)."""
    width = logits.shape[1]
    k = drafts.tokens.shape[1]
    counts = drafts.counts[:, None]
    shift = torch.tensor(leaf_counts)[:, None]
    decided = logits
    if width != k + 1 or bool((counts != k).any()) or any(leaf_counts):  # left-align each row's own k+1 positions
        columns = width - shift - counts - 1 + torch.minimum(torch.arange(k + 1)[None, :], counts)
        rows = torch.arange(len(items))[:, None]
        decided = logits[rows.to(logits.device), columns.to(logits.device)]
    temperature, top_k, top_p = (t[:, None].expand(-1, k + 1) for t in params_tensors([i.sampling for i in items]))
    p = distributions(decided, temperature, top_k, top_p)
    seeds = [item.sampling.seed for item in items]
    positions = [[item.seq.keep_len + len(item.seq.tokens) + j for j in range(k + 1)] for item in items]
    accept_u = uniforms(seeds, positions, DRAW_ACCEPT)[:, :k]
    target_u = uniforms(seeds, positions, DRAW_TARGET)
    accepted, next_token = rejection_sample(p, drafts, accept_u, target_u)
    decisions = [(a, leaf_hit(item.leaves, a, len(item.drafts), token), token)
                 for item, a, token in zip(items, accepted.tolist(), next_token.tolist())]
    hits = [row for row, (_, hit, _) in enumerate(decisions) if hit is not None]
    if hits:  # the token after each kept leaf, from p at that leaf
        rows = torch.tensor(hits)
        columns = torch.tensor([width - leaf_counts[row] + decisions[row][1] for row in hits])
        at_leaf = distributions(logits[rows.to(logits.device), columns.to(logits.device)][:, None],
                                temperature[rows, :1], top_k[rows, :1], top_p[rows, :1]).at((slice(None), 0))
        after = sample(at_leaf.probs(), target_u[rows, torch.tensor([decisions[row][0] + 1 for row in hits])]).tolist()
        for row, token in zip(hits, after):
            decisions[row] = (decisions[row][0], decisions[row][1], token)
    return decisions
