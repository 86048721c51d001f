"""Torch-free facts of speculation that the draft service, the coordinator and its metrics share:
the largest k, and acceptance counted per draft position."""

from __future__ import annotations

# The most tokens a draft may propose per sequence and step: the draft service enforces it, the
# coordinator's admission and policies bound k by it, metrics keep one series per position.
MAX_K = 16
# The most leaves (the draft's next-best tokens, verified beside the chain) per drafted position.
MAX_LEAVES = 8


def tally_positions(outcomes: list[tuple[int, int]], positions: int) -> tuple[list[int], list[int]]:
    """Per draft position i: how many drafts reached it (drafted past i with every earlier
    position accepted) and how many of those were accepted there."""
    reached, accepted = [0] * positions, [0] * positions
    for drafted, kept in outcomes:
        for i in range(min(drafted, kept + 1, positions)):
            reached[i] += 1
            accepted[i] += i < kept
    return reached, accepted
