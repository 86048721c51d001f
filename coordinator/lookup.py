"""Prompt lookup: drafts copied from a request's own history, for no draft call at all.

Where the last few tokens of the history (2 to 4 of them) occurred before, in the prompt or in
what was generated, the tokens that followed them then are proposed as this step's drafts
(Saxena's prompt lookup decoding; vLLM's n-gram proposer). The longest such n-gram is matched,
at its latest occurrence. The target verifies them like any draft, so the output is unchanged:
greedy requests keep the longest agreeing prefix; sampled requests treat each copied token as
drawn from a point mass (q(x) = 1), which rejection sampling turns into exactly the target's
distribution (specbatch.acceptance).

Why it pays on a CPU at batch 1: such a step makes no Propose (the draft and its RPC are about
5 ms of a ~36 ms step on the 2-core Xeon), and the runs it finds are long. On 24 held-out ShareGPT
prompts (the embedded target's greedy answers, 96 tokens each) a 2-to-4-token match exists at
17 % of steps and its 4-token continuation keeps 2.05 tokens on average, against 0.72 for the
EAGLE draft's chain of 2 (docs/engine.md, "Prompt lookup").

The index is incremental: each token the history gains adds its n-grams once, so a lookup costs
a few dictionary reads however long the request runs.
"""

from __future__ import annotations

# The n-gram lengths matched, longest first. On the held-out prompts single tokens matched at
# 55 % of steps but kept 0.81 tokens in 4, too few for the rows they take; 2 and more kept 2.05.
SHORTEST = 2
LONGEST = 4


class PromptLookup:
    """The latest end of every n-gram (SHORTEST ≤ n ≤ LONGEST) of one growing token history,
    but the n-grams ending at its last token (their continuation is what is asked for)."""

    def __init__(self) -> None:
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions 1 … indexed are in latest_end

    def drafts(self, history: list[int], most: int) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the history's
        longest matching suffix; [] where none of its last SHORTEST … LONGEST tokens occurred before."""
        if most <= 0:
            return []
        self._index(history, len(history) - 1)
        for n in range(min(LONGEST, len(history)), SHORTEST - 1, -1):
            end = self.latest_end.get(tuple(history[-n:]))
            if end is not None:
                return history[end : end + most]
        return []

    def _index(self, history: list[int], through: int) -> None:
        if through < self.indexed:  # not the history this index was built on: start over
            self.latest_end.clear()
            self.indexed = 0
        for end in range(self.indexed + 1, through + 1):
            for n in range(SHORTEST, min(LONGEST, end) + 1):
                self.latest_end[tuple(history[end - n : end])] = end
        self.indexed = max(self.indexed, through)
