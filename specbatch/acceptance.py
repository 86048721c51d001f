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
truncated q' the draft really sampled from (specbatch.sampling.SparseDistribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Distributions, sample


def greedy_accept(predicted: list[int], drafts: list[int]) -> tuple[int, int]:
    """``predicted``: the target's argmax after the last accepted token, then after each draft.
    Returns (number of drafts accepted, next token)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
        accepted += 1
    return accepted, predicted[accepted]


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
