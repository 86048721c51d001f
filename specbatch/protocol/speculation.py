"""Torch-free facts of speculation that the draft service, the coordinator and its metrics share:
the largest k, the features' range on the wire, and acceptance counted per draft position."""

from __future__ import annotations

# The most tokens a draft may propose per sequence and step: the draft service enforces it, the
# coordinator's admission and policies bound k by it, metrics keep one series per position.
MAX_K = 16
# The most leaves (the draft's next-best tokens, verified beside the chain) per drafted position.
MAX_LEAVES = 8
# The most further steps one Verify runs (VerifyRequest.further_steps): the model thread is the
# call's for all of them, so other calls on the service wait at most this many steps.
MAX_FURTHER_STEPS = 16
# The target's features cross to a draft as float16 (half float32's bytes), clamped to its range
# first so that every value stays finite: its largest finite value.
FLOAT16_MAX = 65504.0


def leaf_option_problems(leaves: int | None = None) -> list[str]:
    """What is out of range in a leaf count (0 to MAX_LEAVES): the coordinator's flag, a request's
    own value and the draft's items are checked alike."""
    if leaves is None or 0 <= leaves <= MAX_LEAVES:
        return []
    return [f"leaves must be in [0, {MAX_LEAVES}] (got {leaves})"]


def steps_per_call_problems(steps: int) -> list[str]:
    """What is out of range in a count of decode steps a call (1 to MAX_FURTHER_STEPS + 1)."""
    if 1 <= steps <= MAX_FURTHER_STEPS + 1:
        return []
    return [f"steps per call must be in [1, {MAX_FURTHER_STEPS + 1}] (got {steps})"]


def prompt_lookup_problems(most: int | None) -> list[str]:
    """What is out of range in a prompt-lookup length (0 to MAX_K): the coordinator's flag and a
    request's own value are checked alike."""
    if most is None or 0 <= most <= MAX_K:
        return []
    return [f"prompt_lookup must be in [0, {MAX_K}] (got {most})"]


# The most tokens a shared lookup index may keep (--shared-lookup): ~370 bytes of Python objects a
# token (measured on 140k tokens of ShareGPT prompts and answers), so 3.7 GB at this bound.
MAX_SHARED_LOOKUP_TOKENS = 10_000_000


def shared_lookup_problems(tokens: int) -> list[str]:
    """What is out of range in the shared lookup index's size (0: off, to MAX_SHARED_LOOKUP_TOKENS)."""
    if 0 <= tokens <= MAX_SHARED_LOOKUP_TOKENS:
        return []
    return [f"shared_lookup must be in [0, {MAX_SHARED_LOOKUP_TOKENS}] tokens (got {tokens})"]


def tally_positions(outcomes: list[tuple[int, int]], positions: int) -> tuple[list[int], list[int]]:
    """Per draft position i: how many drafts reached it (drafted past i with every earlier
    position accepted) and how many of those were accepted there."""
    reached, accepted = [0] * positions, [0] * positions
    for drafted, kept in outcomes:
        for i in range(min(drafted, kept + 1, positions)):
            reached[i] += 1
            accepted[i] += i < kept
    return reached, accepted
