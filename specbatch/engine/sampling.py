"""Sampling parameters, the distributions they define, and reproducible draws.

A sampled request draws from softmax(logits / T), cut by top-k and then top-p. The target's
version of that is p, the draft's is q; both services compute them here, batched over rows that
each carry their own request's parameters (``Distributions``).

Draws: a seeded request must give the same tokens alone or in any batch, and across a service
restart. So no generator state is kept anywhere: every uniform a request consumes is a hash of
(its seed, the absolute position of the token being decided, the purpose of the draw), see
``uniforms``. A draw never depends on which other sequences share the batch, on the row a
sequence occupies, or on how many draws came before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Torch-free, for the coordinator; imported here too, where the services and tests find it.
from specbatch.protocol.sampling_params import SamplingParams  # noqa: F401

# ---- the distributions ---------------------------------------------------------------------------


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference definition, for one set of parameters: softmax(logits / T) over the tokens
    that survive top-k, renormalised over those that survive top-p. Both cuts keep every token
    tied with the last one kept, so the result never depends on how a sort breaks ties.

    The services use ``distributions`` (batched, no full sort); tests hold it to this one.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values
        # The smallest prefix whose mass reaches top_p: entries whose mass before them is short of it.
        kept = (sorted_probs.cumsum(-1) - sorted_probs < params.top_p).sum(-1, keepdim=True)
        last = sorted_probs.gather(-1, kept - 1)
        probs = probs.masked_fill(probs < last, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class Distributions:
    """Sampling distributions for a batch of logit rows, each under its own parameters, held
    without materialising vocabulary-wide probabilities until a row needs them.

    prob(v) = exp(scaled[v] - log_norm) where scaled[v] >= cutoff, else 0. Leading dimensions
    (rows, positions) are kept as given. Every pass over a vocabulary-wide row counts (a step
    makes a handful): where no row is cut, nothing is masked.
    """

    scaled: torch.Tensor  # [..., V] float32: logits / T (the row's max subtracted first when T is tiny)
    cutoff: torch.Tensor  # [..., 1]: the smallest kept scaled logit (-inf: nothing cut)
    log_norm: torch.Tensor  # [..., 1]: log of the kept mass
    cut: bool = True  # whether any row has a finite cutoff

    def at(self, index) -> "Distributions":
        """The distributions at ``index`` of the leading dimensions."""
        return Distributions(self.scaled[index], self.cutoff[index], self.log_norm[index], self.cut)

    def kept(self) -> torch.Tensor:
        """Scaled logits with the cut tokens at -inf."""
        return self.scaled.masked_fill(self.scaled < self.cutoff, float("-inf")) if self.cut else self.scaled

    def prob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """float64 probabilities of ``tokens`` ([..., n], indexing the last dimension)."""
        scaled = self.scaled.gather(-1, tokens)
        probs = (scaled.double() - self.log_norm.double()).exp()
        return probs.masked_fill(scaled < self.cutoff, 0.0)

    def probs(self) -> torch.Tensor:
        """Full float32 probability rows, [..., V] (a new tensor; they sum to 1 within float
        rounding, and ``sample`` normalises)."""
        probs = self.scaled - self.log_norm
        if self.cut:
            probs.masked_fill_(self.scaled < self.cutoff, float("-inf"))
        return probs.exp_()


def distributions(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> Distributions:
    """The distributions of ``target_distribution`` for rows of logits ``[..., V]`` with per-row
    parameters (each ``logits.shape[:-1]``, temperatures > 0), batched.

    Neither cut sorts the vocabulary: top-k reads the k-th largest logit off ``topk``, and top-p
    looks for its cutoff among the 64 most likely tokens, widening the search only for the rows
    whose nucleus is larger (a full sort over 49k tokens costs more than the model's step).
    """
    shape = logits.shape
    logits = logits.float().reshape(-1, shape[-1])
    device, vocab = logits.device, logits.shape[-1]
    # Which rows need what is decided from the parameters where they are (the host, as
    # params_tensors makes them), so that on a GPU choosing the rows never waits for the device.
    temperature, top_k, top_p = (t.reshape(-1).cpu() for t in (temperature, top_k, top_p))
    tiny = (temperature < 1e-4).nonzero().view(-1)
    top_k_rows = ((top_k > 0) & (top_k < vocab)).nonzero().view(-1)
    top_p_rows = (top_p < 1).nonzero().view(-1)
    on_device = temperature.float().to(device)
    scaled = logits / on_device[:, None]
    if len(tiny):  # logits / T could overflow: subtract the max first (the best token scales to 0)
        tiny = tiny.to(device)
        scaled[tiny] = (logits[tiny] - logits[tiny].amax(-1, keepdim=True)) / on_device[tiny, None]
    cutoff = torch.full((len(scaled), 1), float("-inf"), device=device)
    if len(top_k_rows):
        ks = top_k[top_k_rows].long()
        rows = top_k_rows.to(device)
        largest = torch.topk(scaled[rows], int(ks.max()), dim=-1).values
        cutoff[rows] = largest.gather(-1, ks.to(device)[:, None] - 1)
    if len(top_p_rows):
        rows = top_p_rows.to(device)
        cutoff[rows] = torch.maximum(cutoff[rows], _nucleus_cutoff(scaled[rows], cutoff[rows],
                                                                    top_p[top_p_rows].float().to(device),
                                                                    top_k_cut=bool(len(top_k_rows))))
    result = Distributions(scaled, cutoff, scaled[:, :1], cut=bool(len(top_k_rows) or len(top_p_rows)))
    log_norm = torch.logsumexp(result.kept(), -1, keepdim=True)
    return Distributions(scaled.view(shape), cutoff.view(*shape[:-1], 1), log_norm.view(*shape[:-1], 1), result.cut)


def _nucleus_cutoff(scaled: torch.Tensor, cutoff: torch.Tensor, top_p: torch.Tensor,
                    top_k_cut: bool = True) -> torch.Tensor:
    """Per row: the scaled logit of the last token of the smallest most-likely set whose mass
    reaches top_p (mass after the top-k cut ``cutoff``; ``top_k_cut`` False: no row has one)."""
    kept = scaled.masked_fill(scaled < cutoff, float("-inf")) if top_k_cut else scaled
    log_total = torch.logsumexp(kept, -1, keepdim=True)
    result = torch.empty_like(cutoff)
    todo = torch.arange(len(kept), device=kept.device)
    width = min(64, kept.shape[-1])
    while len(todo):
        values = torch.topk(kept[todo], width, dim=-1).values  # descending
        probs = (values - log_total[todo]).exp()
        count = (probs.cumsum(-1) - probs < top_p[todo, None]).sum(-1, keepdim=True)  # tokens kept, >= 1
        found = (count < width).view(-1) | (width == kept.shape[-1])
        result[todo[found]] = values[found].gather(-1, count[found] - 1)
        todo = todo[~found]
        width = min(8 * width, kept.shape[-1])
    return result


def params_tensors(params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) rows for ``distributions``."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float64),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float64))


# ---- draws ---------------------------------------------------------------------------------------

# What a uniform decides; one position of one request draws each at most once per step.
DRAW_DRAFT = 1  # the draft's proposal at this position
DRAW_ACCEPT = 2  # whether the target keeps that proposal
DRAW_TARGET = 3  # the target's own token here: from the residual after a rejection, or from p
DRAW_EMULATED = 4  # whether an emulated-acceptance target keeps the draft here (target_service.verifier)

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser: a bijective 64-bit mix (uint64 arithmetic wraps in numpy)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def uniforms(seeds: list[int], positions, purpose: int) -> torch.Tensor:
    """Uniform draws in [0, 1), float64, one per (row, position): row i's seed ``seeds[i]``,
    ``positions`` [rows, n] absolute token positions. A pure function of its inputs."""
    seeds = np.asarray(seeds, dtype=np.uint64).reshape(-1, 1)
    positions = np.asarray(positions, dtype=np.uint64).reshape(len(seeds), -1)
    with np.errstate(over="ignore"):
        stream = _splitmix64(seeds ^ _splitmix64(np.full_like(seeds, purpose)))
        bits = _splitmix64(stream + _splitmix64(positions))
    return torch.from_numpy(((bits >> _U64(11)).astype(np.float64)) * 2.0**-53)


def sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: per row of non-negative ``weights`` [rows, n] (normalised or not; the
    cumulative sum is float64), the index whose cumulative interval holds ``u * total``. Zero
    weights are never drawn."""
    cumulative = weights.cumsum(-1, dtype=torch.float64)
    point = u.to(cumulative.device, torch.float64)[:, None] * cumulative[:, -1:]
    index = torch.searchsorted(cumulative, point, right=True).view(-1)
    # u * total can round up to total itself: take the last index with weight then.
    over = (index == weights.shape[-1]).nonzero().view(-1)
    if len(over):
        index[over] = weights.shape[-1] - 1 - (weights[over] > 0).flip(-1).long().argmax(-1)
    return index


# The most tokens a draft distribution may list. The target pads every q' of a call to the
# longest one ([sequences, k, support] arrays), so this bounds a call's memory: 256 sequences x
# k=16 x 1024 entries is 70 MB. Drafts send 32 (draft_service.proposer.SUPPORT_SIZE).
MAX_SUPPORT = 1024


@dataclass
class SparseDistribution:
    """q' at one drafted position: the distribution the draft really sampled its token from,
    as the tokens it can give and their probabilities: q'(token_ids[j]) = probs[j] / sum(probs).
    The probabilities are the draft's own (after the request's parameters) for its most likely
    tokens, so they sum to the mass the cut kept, not to 1."""

    token_ids: np.ndarray  # int64 [n]
    probs: np.ndarray  # float32 [n], > 0

