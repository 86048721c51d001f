"""A request's sampling parameters and their checks. Torch-free: the coordinator validates and
carries them; the distributions they define are specbatch/engine/sampling.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
        if not 0 <= self.seed < 2**64:
            found.append(f"seed must be in [0, 2^64) (got {self.seed})")
        return found
