"""The acceptance rule: which drafted tokens the target keeps, and the token that follows them.

Greedy requests: keep the longest prefix of the draft that equals the target's own argmax at each
position, then append the target's argmax after it. The output is exactly what target-only
greedy decoding gives, whatever the draft proposed.

Sampled requests: speculative (rejection) sampling (Leviathan et al., arXiv 2211.17192; Chen et
al., arXiv 2302.01318). Draft token x, drawn from q, is kept with probability min(1, p(x)/q(x));
at the first rejection the token is drawn instead from the residual norm(max(0, p - q)); when
all drafts are kept, one more token is drawn from p. Every emitted token then follows p exactly,
whatever q was: P(x kept) + P(rejected, residual gives x) = min(p, q)(x) + (p - q)+(x) = p(x).
p and q are each model's distribution after the request's temperature/top-k/top-p; q is the
truncated q' the draft really sampled from (specbatch.engine.sampling.SparseDistribution); a q' that
cannot be what the draft sampled from is refused before anything runs (``sampled_drafts``).

Leaves (the draft's next-best tokens at a drafted position, verified in the same forward as
the chain, each seeing the chain before its position only): the rule above runs unchanged on
the chain; where it rejects position j and the token it emits there (the target's argmax, or
the residual's draw) is one of position j's leaves, the target's computation at that leaf is
already done, so the token after it comes from that leaf's row (argmax, or a draw from p there)
in the same step. Which token is emitted at j never depends on the leaves, so output stays
exactly what the chain alone gives, one token further per hit (``leaf_hit``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specbatch.engine.sampling import MAX_SUPPORT, Distributions, SparseDistribution, sample
from specbatch.protocol.errors import InvalidRequest


def greedy_accept(predicted: list[int], drafts: list[int]) -> tuple[int, int]:
    """``predicted``: the target's argmax after the last accepted token, then after each draft.
    Returns (number of drafts accepted, next token)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
        accepted += 1
    return accepted, predicted[accepted]


def leaf_hit(leaves: list[list[int]], accepted: int, drafted: int, token: int) -> int | None:
    """Which leaf, counted over all positions' leaves in order, the target kept: the one at the
    rejected position ``accepted`` equal to the target's ``token`` there; None when the chain
    was kept whole or the token is no leaf."""
    if accepted >= min(drafted, len(leaves)) or token not in leaves[accepted]:
        return None
    return sum(len(at) for at in leaves[:accepted]) + leaves[accepted].index(token)


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for draft tokens x (q(x) > 0: the draft drew x from q)."""
    return (p_x / q_x).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), rows [B, V], unnormalised (the draw normalises): what the target draws from
    after rejecting a draft. q is sparse (q' is zero off its support, so there p - q = p).

    A rejection at x means p(x) < q(x), so p - q has positive mass somewhere; only float
    rounding can leave none, and then p itself is the right answer (p and q are equal)."""
    # p - min(p, q) on q's support: exactly max(0, p - q), and zero-probability padding adds 0.
    residual = p.clone().scatter_add_(1, q_ids, -torch.minimum(p.gather(1, q_ids), q_probs.to(p.dtype)))
    empty = residual.sum(-1) <= 0
    return torch.where(empty[:, None], p, residual) if empty.any() else residual


@dataclass
class SampledDrafts:
    """The drafts of B sampled sequences, padded to K per row, and the q' each was drawn from."""

    tokens: torch.Tensor  # [B, K] long; past a row's count, any token
    counts: torch.Tensor  # [B] long: drafts per row
    q_ids: torch.Tensor  # [B, K, N] long: q' support per drafted position, padded with weight 0
    q_probs: torch.Tensor  # [B, K, N] float64, each row of N normalised to sum 1

    def to(self, device) -> "SampledDrafts":
        return SampledDrafts(*(t.to(device) for t in (self.tokens, self.counts, self.q_ids, self.q_probs)))

    def prob_of_drafts(self) -> torch.Tensor:
        """q'(x) of each draft token, [B, K]."""
        return (self.q_probs * (self.q_ids == self.tokens[..., None])).sum(-1)

    def q_at(self, rows: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q' of ``rows`` at one drafted position each: support ids and probabilities, [rows, N]
        each (padding has probability 0, so it changes nothing)."""
        return self.q_ids[rows, position], self.q_probs[rows, position]


def sampled_drafts(seq_ids: list[str], drafts: list[list[int]], draft_distributions: list[list[SparseDistribution]],
                   vocab_size: int) -> SampledDrafts:
    """Pad B sampled sequences' drafts and the q' each was drawn from into tensors, refusing any
    q' that cannot be what the draft sampled from (the acceptance test would then be wrong, not
    just slow)."""
    for seq_id, row_tokens, row_dists in zip(seq_ids, drafts, draft_distributions):
        if len(row_dists) != len(row_tokens):
            raise InvalidRequest(f"sequence {seq_id!r}: sampled requests need the draft's distribution of "
                                 f"each draft token ({len(row_dists)} for {len(row_tokens)} drafts)")
    rows_count = len(seq_ids)
    k = max(len(tokens) for tokens in drafts)
    dists = [(row, j, dist) for row, row_dists in enumerate(draft_distributions) for j, dist in enumerate(row_dists)]
    sizes = np.array([len(dist.token_ids) for _, _, dist in dists], dtype=np.int64)
    n = int(sizes.max(initial=1))
    tokens = np.zeros((rows_count, k), dtype=np.int64)
    for row, row_tokens in enumerate(drafts):
        tokens[row, : len(row_tokens)] = row_tokens
    ids = np.zeros((rows_count, k, n), dtype=np.int64)
    probs = np.zeros((rows_count, k, n), dtype=np.float64)
    present = np.zeros((rows_count, k, n), dtype=bool)
    for (row, j, dist), size in zip(dists, sizes):
        if not 0 < size <= MAX_SUPPORT or len(dist.probs) != size:
            raise InvalidRequest(f"sequence {seq_ids[row]!r}: draft distribution {j} has {size} token ids "
                                 f"and {len(dist.probs)} probabilities (1 to {MAX_SUPPORT} of each, as many of both)")
    if dists:  # scatter every q' into the padded arrays at once
        rows = np.repeat([row for row, _, _ in dists], sizes)
        positions = np.repeat([j for _, j, _ in dists], sizes)
        slots = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        ids[rows, positions, slots] = np.concatenate([dist.token_ids for _, _, dist in dists])
        probs[rows, positions, slots] = np.concatenate([dist.probs for _, _, dist in dists])
        present[rows, positions, slots] = True

    def refuse(bad: np.ndarray, what: str):
        row = int(np.argwhere(bad)[0][0])
        raise InvalidRequest(f"sequence {seq_ids[row]!r}: draft distribution {what}")

    if ((ids < 0) | (ids >= vocab_size)).any():
        refuse((ids < 0) | (ids >= vocab_size), f"has token ids outside [0, {vocab_size})")
    if (~np.isfinite(probs) | (probs < 0)).any():
        refuse(~np.isfinite(probs) | (probs < 0), "has probabilities that are negative or not finite")
    total = probs.sum(-1, keepdims=True)
    counts = [len(row_tokens) for row_tokens in drafts]
    drafted = np.arange(k)[None, :] < np.array(counts)[:, None]
    if (drafted & (total[..., 0] <= 0)).any():
        refuse(drafted & (total[..., 0] <= 0), "has no probability mass")
    ordered = np.sort(np.where(present, ids, -1 - np.arange(n)), axis=-1)  # padding never repeats
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        refuse((ordered[..., 1:] == ordered[..., :-1]).any(-1), "lists a token id twice")
    probs = np.divide(probs, total, out=np.zeros_like(probs), where=total > 0)
    result = SampledDrafts(torch.from_numpy(tokens), torch.tensor(counts),
                           torch.from_numpy(ids), torch.from_numpy(probs))
    if (torch.from_numpy(drafted) & (result.prob_of_drafts() <= 0)).any():
        refuse(drafted & (result.prob_of_drafts() <= 0).numpy(), "gives its draft token no probability")
    return result


def rejection_sample(p: Distributions, drafts: SampledDrafts, accept_u: torch.Tensor,
                     target_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for B sequences at once.

    ``p``: the target's distributions [B, K+1, V] at the position after the last accepted token
    and after each draft. ``accept_u`` [B, K] and ``target_u`` [B, K+1]: each sequence's uniforms
    for the accept test of each draft and for the target's own draw at each position.
    Returns (drafts accepted [B], next token [B]).
    """
    device = p.scaled.device
    drafts, accept_u, target_u = drafts.to(device), accept_u.to(device), target_u.to(device)
    batch, k = drafts.tokens.shape
    drafted = torch.arange(k, device=device)[None, :] < drafts.counts[:, None]
    p_x = p.at((slice(None), slice(0, k))).prob_of(drafts.tokens[..., None])[..., 0]
    keep = (accept_u < acceptance_probability(p_x, drafts.prob_of_drafts())) & drafted
    accepted = keep.long().cumprod(-1).sum(-1)  # the leading run of kept drafts
    rows = torch.arange(batch, device=device)
    final = p.at((rows, accepted)).probs()  # p at the first position not decided by a kept draft
    rejected = (accepted < drafts.counts).nonzero().view(-1)
    if len(rejected):
        final[rejected] = residual_distribution(final[rejected], *drafts.q_at(rejected, accepted[rejected]))
    next_token = sample(final, target_u[rows, accepted])
    return accepted, next_token
