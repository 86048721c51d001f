"""The k policy: how many tokens the draft proposes per sequence, given the live batch size.

Only ``fixed:K`` exists here; the profile-driven policies (the paper's batch size -> best k, and
goodput) plug in behind the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedK:
    k: int

    def k_for(self, batch_size: int) -> int:
        return self.k

    def describe(self) -> str:
        return f"fixed:{self.k}"


def parse_policy(text: str, max_k: int):
    kind, _, arg = text.partition(":")
    if kind == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"fixed policy needs an integer k, as in fixed:3 (got {text!r})") from None
        if not 0 <= k <= max_k:
            raise ValueError(f"k must be in [0, {max_k}] (got {k})")
        return FixedK(k)
    raise ValueError(f"unknown k policy {text!r}; known: fixed:K")
