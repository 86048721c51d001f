"""Prompt lookup: drafts copied from a request's own history, for no draft call at all.

Where the last few tokens of the history (2 to 4 of them) occurred before, in the prompt or in
what was generated, the tokens that followed them then are proposed as this step's drafts
(Saxena's prompt lookup decoding; vLLM's n-gram proposer). The longest such n-gram is matched,
at its latest occurrence. The target verifies them like any draft, so the output is unchanged:
greedy requests keep the longest agreeing prefix; sampled requests treat each copied token as
drawn from a point mass (q(x) = 1), which rejection sampling turns into exactly the target's
distribution (specbatch.engine.acceptance).

Why it pays at batch 1: such a step makes no Propose (the draft's compute and its call), and
where a request repeats itself the runs it finds are long, so they keep more tokens than the
draft's chain (docs/decisions/prompt-lookup.md).

The index is incremental: each token the history gains adds its n-grams once, so a lookup costs
a few dictionary reads however long the request runs.

Shared lookup (``SharedLookup``, the coordinator's ``--shared-lookup``): where a request's own
history has no match, the histories of requests that finished before it are searched the same
way (SuffixDecoding's global tree of earlier outputs, arXiv 2411.04975, and vLLM's suffix
proposer are the same idea). Answers repeat across users: the same model gives the same phrases,
openings and formats to different prompts. Other texts match less surely than a request's own,
so the continuation is voted on: the longest suffix of the history (3 to 8 tokens) is found in
the most recent texts that hold it, and their next tokens are followed while they agree (the
first token chosen by at least half of them, the chain while the product of the shares stays at
or above a quarter): first tokens backed by fewer than half of the matches keep too little to
pay for the step (docs/decisions/shared-lookup-off.md). The target verifies what is drafted, so output is unchanged; what other requests'
texts can change is the step's time, which is why a request may keep out (``shared_lookup =
false``: it neither drafts from the index nor adds to it).
"""

from __future__ import annotations

import collections

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


# Shared lookup: the n-gram found in other texts is 3 to 8 tokens long. Where only 2 tokens
# matched across requests, the chains mostly kept 0.09-0.38 tokens, too few to pay for a step
# without a Propose (those backed by at least 4 matches and half their votes kept 0.85: untried).
SHARED_SHORTEST = 3
SHARED_LONGEST = 8
# The most recent occurrences of a 3-gram that a lookup weighs (the index keeps no more): bounds a
# lookup's work at a common phrase.
SHARED_OCCURRENCES = 128
# The first drafted token needs at least this share of the matches' next tokens; the chain goes on
# while the product of the shares is at least CHAIN_SUPPORT.
FIRST_SUPPORT = 0.5
CHAIN_SUPPORT = 0.25
_END_BITS = 32  # an occurrence is (text number << _END_BITS) | end


class SharedLookup:
    """The histories of finished requests (at most ``max_tokens`` tokens, the oldest dropped
    first), indexed by their 3-grams, for drafts where a request's own history has none. Used by
    the scheduler's thread only."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.texts: dict[int, list[int]] = {}  # by number, oldest first (dicts keep their order)
        self.next_text = 0
        self.tokens = 0  # in self.texts
        # 3-gram -> its latest occurrences in self.texts, oldest first: (text << _END_BITS) | the
        # position after it (where its continuation starts).
        self.ends: dict[tuple[int, ...], collections.deque[int]] = {}

    def add(self, history: list[int]) -> None:
        """A finished request's prompt and output (its last max_tokens tokens at most)."""
        text = list(history[-self.max_tokens :])
        if len(text) <= SHARED_SHORTEST:
            return
        while self.texts and self.tokens + len(text) > self.max_tokens:
            self._drop_oldest()
        number = self.next_text
        self.next_text += 1
        self.texts[number] = text
        self.tokens += len(text)
        for end in range(SHARED_SHORTEST, len(text)):  # a continuation follows each
            key = tuple(text[end - SHARED_SHORTEST : end])
            occurrences = self.ends.get(key)
            if occurrences is None:
                occurrences = self.ends[key] = collections.deque(maxlen=SHARED_OCCURRENCES)
            occurrences.append(number << _END_BITS | end)

    def _drop_oldest(self) -> None:
        number, text = next(iter(self.texts.items()))
        del self.texts[number]
        self.tokens -= len(text)
        for end in range(SHARED_SHORTEST, len(text)):
            key = tuple(text[end - SHARED_SHORTEST : end])
            occurrences = self.ends.get(key)
            # Texts enter and leave in order, so this text's occurrences are the oldest left.
            while occurrences and occurrences[0] >> _END_BITS == number:
                occurrences.popleft()
            if occurrences is not None and not occurrences:
                del self.ends[key]

    def drafts(self, history: list[int], most: int) -> list[int]:
        """Up to ``most`` tokens the indexed texts agree follow the history's longest suffix
        (SHARED_SHORTEST … SHARED_LONGEST tokens) found in them; [] where none or where they disagree."""
        if most <= 0 or len(history) < SHARED_SHORTEST:
            return []
        occurrences = self.ends.get(tuple(history[-SHARED_SHORTEST:]))
        if not occurrences:
            return []
        longest, continuations = 0, []
        for occurrence in occurrences:
            text, end = self.texts[occurrence >> _END_BITS], occurrence & ((1 << _END_BITS) - 1)
            n = SHARED_SHORTEST
            while n < min(SHARED_LONGEST, len(history)) and n < end and text[end - n - 1] == history[-n - 1]:
                n += 1
            if n > longest:
                longest, continuations = n, []
            if n == longest:
                continuations.append(text[end : end + most])
        return agreed(continuations, most)


def agreed(continuations: list[list[int]], most: int) -> list[int]:
    """The tokens the continuations agree on, position by position (each the most common among
    those that agreed so far), while the shares' product stays at least CHAIN_SUPPORT; [] where
    the first token has less than FIRST_SUPPORT of them."""
    out, support = [], 1.0
    for position in range(most):
        counts = collections.Counter(c[position] for c in continuations if len(c) > position)
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        share = count / len(continuations)
        if position == 0 and share < FIRST_SUPPORT:
            return []
        support *= share
        if support < CHAIN_SUPPORT:
            break
        out.append(token)
        continuations = [c for c in continuations if len(c) > position and c[position] == token]
    return out
