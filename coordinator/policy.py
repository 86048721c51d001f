"""The k policy: how many tokens the draft proposes per sequence at a step, given the live batch size.

``fixed:K``  always K.
``profile``  the paper's method (arXiv 2310.18813): the profile's best k for the live batch size,
             interpolated between the profiled sizes.
``goodput``  beyond the paper: the k in 0 … max_k that maximises expected tokens per second,
             batch × E[tokens per sequence | k] / step_ms(batch, k), with the step times from the
             profile and the acceptance per draft position measured live (a moving average that
             starts from the profile's). k = 0 wins when speculation does not pay: when drafts
             are rarely accepted, or when verifying more tokens costs too much at this batch size.

The scheduler asks ``k_for(batch_size)`` at each step and reports what happened with
``observe(outcomes)``: one (drafted, accepted) pair per sequence of the step. With leaves on
(``--leaves N``: the draft's N next-best tokens at the first drafted position), it also asks
``leaves_for(batch_size, k, most)``, how many of them the target verifies beside the chain, and
reports ``observe_first_rejections(ranks)``: where the target's token stood among them at each
rejected first draft. ``fixed:K`` and ``profile`` verify all N; ``goodput`` chooses k and the
leaves together, from the profile's Verify times by row count and the live hit rate by rank.

k is one number per step, not per sequence: the draft and the target each pad a call to its
longest row, so a sequence drafting fewer tokens than its neighbours saves almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbatch.speculation import tally_positions
from specbatch.profile import expected_tokens

from .profile_file import ProfileFile


class AllLeaves:
    """Policies that verify every leaf they are offered and learn nothing from them."""

    def leaves_for(self, batch_size: int, k: int, most: int) -> int:
        return most

    def observe_first_rejections(self, ranks: list[int | None]) -> None:
        pass


@dataclass(frozen=True)
class FixedK(AllLeaves):
    k: int

    def k_for(self, batch_size: int) -> int:
        return self.k

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        pass

    def describe(self) -> str:
        return f"fixed:{self.k}"


class ProfileK(AllLeaves):
    """The paper's policy: the profile's batch size -> best k table."""

    def __init__(self, profile_file: ProfileFile):
        self.profile_file = profile_file

    def k_for(self, batch_size: int) -> int:
        return self.profile_file.profile.best_k_for(batch_size)

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        pass

    def describe(self) -> str:
        return "profile"


class LiveAcceptance:
    """Acceptance per draft position, as an exponential moving average over the drafts that
    reached each position (half its weight from the last ``half_life`` of them), starting from
    the profile's rates. It moves only when something is drafted."""

    def __init__(self, start: tuple[float, ...] | list[float], half_life: float = 64.0):
        self.keep = 0.5 ** (1.0 / half_life)
        self.rates = list(start)

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        reached, accepted = tally_positions(outcomes, len(self.rates))
        for i, (n, m) in enumerate(zip(reached, accepted)):
            if n:
                weight = self.keep**n  # n drafts reached position i: n updates at once
                self.rates[i] = weight * self.rates[i] + (1.0 - weight) * m / n


class LeafRanks:
    """How often the target's token at a rejected first draft is the draft's r-th next-best token,
    r = 1 … n: moving averages over those rejections (half their weight from the last
    ``half_life``), divided by the weight seen so far, so they need no starting value."""

    def __init__(self, n: int, half_life: float = 64.0):
        self.keep = 0.5 ** (1.0 / half_life)
        self.sums, self.weight = [0.0] * n, 0.0

    def observe(self, ranks: list[int | None]) -> None:
        """One entry per rejected first draft: the 0-based rank among the n next-best tokens of
        the token the target emitted there, or None when it was none of them."""
        for rank in ranks:
            self.weight = self.keep * self.weight + (1.0 - self.keep)
            self.sums = [self.keep * total + (1.0 - self.keep) * (rank == r) for r, total in enumerate(self.sums)]

    def hit_rate(self, leaves: int) -> float:
        """P(one of the first ``leaves`` next-best tokens is the target's | the first draft is rejected)."""
        return sum(self.sums[:leaves]) / self.weight if self.weight else 0.0


class Goodput:
    """Maximise expected tokens per second: profile step times × live acceptance per position.

    While live acceptance keeps it at k = 0 it learns nothing new, so one step in
    ``probe_every`` such steps drafts what the profile's own acceptance would choose: a draft
    that has become good again is noticed, at the cost of an occasional longer step. A reloaded
    profile (a new draft, new hardware) restarts the live estimate from the new profile's rates.
    """

    def __init__(self, profile_file: ProfileFile, max_k: int, half_life: float = 64.0, probe_every: int = 32,
                 max_leaves: int = 0):
        self.profile_file, self.max_k = profile_file, max_k
        self.half_life, self.probe_every = half_life, probe_every
        self.idle_steps = 0  # steps since one drafted anything
        self.leaf_ranks = LeafRanks(max_leaves, half_life)
        self._profile = None
        self._chosen: dict[int, tuple[int, int]] = {}  # batch size -> (k, leaves), until the next observation
        self._sync()

    def _sync(self):
        profile = self.profile_file.profile
        if profile is not self._profile:  # at start, or the file was reloaded
            self._profile = profile
            self.acceptance = LiveAcceptance(profile.acceptance_by_position[: self.max_k], self.half_life)
            self._chosen.clear()
        return profile

    def acceptance_by_position(self) -> list[float]:
        self._sync()
        return list(self.acceptance.rates)

    def goodput(self, batch_size: int, k: int, acceptance, leaves: int = 0) -> float:
        """Expected tokens per millisecond for the whole batch at this k, with ``leaves`` verified
        beside the first draft: each adds a row to every sequence of the Verify call (the profile's
        Verify time at k + leaves drafts), and a rejected first draft whose target token is one of
        them yields one token more."""
        profile = self._profile
        tokens = expected_tokens(acceptance, k)
        step = profile.step_ms(batch_size, k)
        if leaves:
            tokens += (1.0 - acceptance[0]) * self.leaf_ranks.hit_rate(leaves)
            step += profile.target_ms(batch_size, k + leaves) - profile.target_ms(batch_size, k)
        return batch_size * tokens / step

    def _leaf_choices(self, k: int, most: int) -> range:
        """Leaves that can go with k: none without a draft, and no more rows than the profile
        measured (none at all for a k past it)."""
        return range(max(0, min(most, min(self._profile.max_k, self.max_k) - k)) + 1 if k else 1)

    def _best(self, batch_size: int, acceptance) -> tuple[int, int]:
        """The (k, leaves) of most expected tokens per millisecond. Ties go to the smaller k, then to
        fewer leaves: as fast, and less work thrown away when drafts miss."""
        choices = [(k, leaves) for k in range(min(self._profile.max_k, self.max_k) + 1)
                   for leaves in self._leaf_choices(k, len(self.leaf_ranks.sums))]
        return max(choices, key=lambda c: (self.goodput(batch_size, c[0], acceptance, c[1]), -c[0], -c[1]))

    def best_k(self, batch_size: int, acceptance) -> int:
        return self._best(batch_size, acceptance)[0]

    def _choice(self, batch_size: int) -> tuple[int, int]:
        profile = self._sync()
        if batch_size not in self._chosen:
            choice = self._best(batch_size, self.acceptance.rates)
            if choice[0] == 0 and self.idle_steps >= self.probe_every:
                # a probe (0 where drafting never pays)
                choice = self._best(batch_size, profile.acceptance_by_position)
            self._chosen[batch_size] = choice
        return self._chosen[batch_size]

    def k_for(self, batch_size: int) -> int:
        return self._choice(batch_size)[0]

    def leaves_for(self, batch_size: int, k: int, most: int) -> int:
        """The leaves chosen with k; for a request held to another k (its own, or its length
        limit), the best for that k."""
        chosen_k, leaves = self._choice(batch_size)
        if k != chosen_k:
            choices, rates = self._leaf_choices(k, most), self.acceptance.rates
            # A k past the profile's has no step time to price leaves with: none then.
            leaves = 0 if len(choices) == 1 else max(choices, key=lambda n: (self.goodput(batch_size, k, rates, n), -n))
        return min(leaves, most)

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        self._sync()
        self.acceptance.observe(outcomes)
        self.idle_steps = 0 if outcomes else self.idle_steps + 1
        self._chosen.clear()

    def observe_first_rejections(self, ranks: list[int | None]) -> None:
        self.leaf_ranks.observe(ranks)
        self._chosen.clear()

    def describe(self) -> str:
        return "goodput"


KNOWN = "fixed:K, profile, goodput"


def parse_policy(text: str, max_k: int, profile_file: ProfileFile | None = None, max_leaves: int = 0):
    kind, _, arg = text.partition(":")
    if kind == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"fixed policy needs an integer k, as in fixed:3 (got {text!r})") from None
        if not 0 <= k <= max_k:
            raise ValueError(f"k must be in [0, {max_k}] (got {k})")
        return FixedK(k)
    if kind in ("profile", "goodput") and not arg:
        if profile_file is None:
            raise ValueError(f"the {kind} policy needs a profile: pass --profile PATH (made by `specbatch profile`)")
        return ProfileK(profile_file) if kind == "profile" else Goodput(profile_file, max_k, max_leaves=max_leaves)
    raise ValueError(f"unknown k policy {text!r}; known: {KNOWN}")
