"""Sampling parameters, their validation, and reproducible per-position draws.

A seeded request must give the same tokens alone or in any batch, at any k, and across a service
restart. So no generator state is kept anywhere: the draw for a token is seeded from the request's
seed and the token's absolute position in the sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problems(self) -> list[str]:
        """What is wrong with these parameters, in words; empty when they are valid."""
        found = []
        if not math.isfinite(self.temperature) or self.temperature < 0:
            found.append(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            found.append(f"top_k must be >= 0 (got {self.top_k})")
        return found


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax(logits / T) cut by top-k, then top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def position_generator(seed: int, position: int) -> torch.Generator:
    """A generator for the draw at one absolute position of one seeded request."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed(mixed)


def next_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at ``position`` from one row of logits: argmax, or a seeded draw."""
    if params.greedy:
        return int(logits.argmax())
    probs = target_distribution(logits, params).cpu()
    return int(torch.multinomial(probs, 1, generator=position_generator(params.seed, position)))
