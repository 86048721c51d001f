"""The acceptance rule: which drafted tokens the target keeps, and the token that follows them.

Greedy verification keeps the longest prefix of the draft that equals the target's own argmax at
each position, then appends the target's argmax after it. The output is therefore exactly what
target-only greedy decoding gives, whatever the draft proposed.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams, next_token


def accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams, first_position: int) -> tuple[int, int]:
    """Verify one sequence's drafts.

    ``logits`` holds the target's logits for ``len(drafts) + 1`` positions: the one after the
    last accepted token, then one after each draft token. ``first_position`` is the absolute
    position of the first token to be decided. Returns (number of drafts accepted, next token).
    """
    if not params.greedy:
        # Sampled requests run without drafts until lossless rejection sampling lands (issue 4):
        # one draw from the target's own distribution is exact.
        return 0, next_token(logits[0], params, first_position)
    predicted = logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
        accepted += 1
    return accepted, predicted[accepted]
