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
``observe(outcomes)``: one (drafted, accepted) pair per sequence of the step.

k is one number per step, not per sequence: the draft and the target each pad a call to its
longest row, so a sequence drafting fewer tokens than its neighbours saves almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbatch.speculation import tally_positions
from specbatch.profile import expected_tokens

from .profile_file import ProfileFile


@dataclass(frozen=True)
class FixedK:
    k: int

    def k_for(self, batch_size: int) -> int:
        return self.k

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        pass

    def describe(self) -> str:
        return f"fixed:{self.k}"


class ProfileK:
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


class Goodput:
    """Maximise expected tokens per second: profile step times × live acceptance per position.

    While live acceptance keeps it at k = 0 it learns nothing new, so one step in
    ``probe_every`` such steps drafts what the profile's own acceptance would choose: a draft
    that has become good again is noticed, at the cost of an occasional longer step. A reloaded
    profile (a new draft, new hardware) restarts the live estimate from the new profile's rates.
    """

    def __init__(self, profile_file: ProfileFile, max_k: int, half_life: float = 64.0, probe_every: int = 32):
        self.profile_file, self.max_k = profile_file, max_k
        self.half_life, self.probe_every = half_life, probe_every
        self.idle_steps = 0  # steps since one drafted anything
        self._profile = None
        self._chosen: dict[int, int] = {}  # batch size -> k, until the next observation
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

    def goodput(self, batch_size: int, k: int, acceptance) -> float:
        """Expected tokens per millisecond for the whole batch at this k."""
        return batch_size * expected_tokens(acceptance, k) / self._profile.step_ms(batch_size, k)

    def best_k(self, batch_size: int, acceptance) -> int:
        ks = range(min(self._profile.max_k, self.max_k) + 1)
        # Ties go to the smaller k: as fast, and less work thrown away when drafts miss.
        return max(ks, key=lambda k: (self.goodput(batch_size, k, acceptance), -k))

    def k_for(self, batch_size: int) -> int:
        profile = self._sync()
        if batch_size not in self._chosen:
            k = self.best_k(batch_size, self.acceptance.rates)
            if k == 0 and self.idle_steps >= self.probe_every:
                k = self.best_k(batch_size, profile.acceptance_by_position)  # a probe (0 where drafting never pays)
            self._chosen[batch_size] = k
        return self._chosen[batch_size]

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        self._sync()
        self.acceptance.observe(outcomes)
        self.idle_steps = 0 if outcomes else self.idle_steps + 1
        self._chosen.clear()

    def describe(self) -> str:
        return "goodput"


KNOWN = "fixed:K, profile, goodput"


def parse_policy(text: str, max_k: int, profile_file: ProfileFile | None = None):
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
        return ProfileK(profile_file) if kind == "profile" else Goodput(profile_file, max_k)
    raise ValueError(f"unknown k policy {text!r}; known: {KNOWN}")
