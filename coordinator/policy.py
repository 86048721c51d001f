"""The k policy: how many tokens the draft proposes per sequence at a step, given the live batch size.

``fixed:K``  always K.
``profile``  the paper's method (arXiv 2310.18813): the profile's best k for the live batch size,
             interpolated between the profiled sizes.
``goodput``  beyond the paper: the k in 0 … max_k that maximises expected tokens per second,
             batch × E[tokens per sequence | k] / step_ms(batch, k), with the step times from the
             profile and the acceptance per draft position measured live (a moving average that
             starts from the profile's). k = 0 wins when speculation does not pay: when drafts
             are rarely accepted, or when verifying more tokens costs too much at this batch size.
             ``goodput:live`` measures the step times live too (coordinator/step_times.py).

The scheduler asks ``k_for(batch_size)`` at each step (and ``probing(batch_size)``: whether that
k is a probe, a step run to measure it rather than the best known) and reports what happened with
``observe(outcomes)``: one (drafted, accepted) pair per sequence of the step, and with
``observe_times(StepTimes)``: what its Propose, its Verify and the whole step took. With leaves on
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

from specbatch.protocol.profile import expected_tokens
from specbatch.protocol.speculation import tally_positions

from .profile_file import ProfileFile
from .step_times import LiveStepTimes, StepTimes


class AllLeaves:
    """Policies that verify every leaf they are offered and learn nothing from them, nor from
    step times."""

    def leaves_for(self, batch_size: int, k: int, most: int) -> int:
        return most

    def observe_first_rejections(self, ranks: list[int | None]) -> None:
        pass

    def observe_times(self, times: StepTimes) -> None:
        pass

    def probing(self, batch_size: int) -> bool:
        return False


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
    """Maximise expected tokens per second: the profile's step times × live acceptance per
    position; with ``live_times`` (``goodput:live``), step times measured live too
    (``LiveStepTimes``). Those learn only the ks that are run, so then one step in
    ``probe_every`` runs a neighbour of the best k (the one measured less at this batch size, of
    those priced within ``probe_within`` of the best): a nearly as good step, and the slope that
    prices the ks beyond.

    While live acceptance keeps it at k = 0 it learns nothing new, so one step in
    ``probe_every`` such steps drafts what the profile's own acceptance would choose: a draft
    that has become good again is noticed, at the cost of an occasional longer step. A reloaded
    profile (a new draft, new hardware) restarts the live estimate from the new profile's rates.
    """

    def __init__(self, profile_file: ProfileFile, max_k: int, half_life: float = 64.0, probe_every: int = 32,
                 max_leaves: int = 0, live_times: bool = False):
        self.profile_file, self.max_k, self.live_times = profile_file, max_k, live_times
        self.half_life, self.probe_every = half_life, probe_every
        self.probe_within = 0.9  # goodput:live probes a neighbouring k priced at this share of the best or more
        self.idle_steps = 0  # steps since one drafted anything
        self.timed_steps = 0  # steps whose times were observed
        self.leaf_ranks = LeafRanks(max_leaves, half_life)
        self._profile = None
        self._chosen: dict[int, tuple[int, int]] = {}  # batch size -> (k, leaves), until the next observation
        # goodput:live prices every (k, leaves) afresh only every few served steps: its step times are
        # medians of windows of 32 and its rates moving averages of 64, so a choice priced a few steps
        # ago is the same choice, and pricing them all was most of the coordinator's work in a step.
        self.reprice_every = 4
        self._priced: dict[int, tuple[int, tuple[int, int]]] = {}  # batch size -> (timed step, best (k, leaves))
        self._sync()

    def _sync(self):
        profile = self.profile_file.profile
        if profile is not self._profile:  # at start, or the file was reloaded
            self._profile = profile
            self.acceptance = LiveAcceptance(profile.acceptance_by_position[: self.max_k], self.half_life)
            self.times = LiveStepTimes(profile) if self.live_times else profile
            self._chosen.clear()
            self._priced.clear()
        return profile

    def acceptance_by_position(self) -> list[float]:
        self._sync()
        return list(self.acceptance.rates)

    def goodput(self, batch_size: int, k: int, acceptance, leaves: int = 0) -> float:
        """Expected tokens per millisecond for the whole batch at this k, with ``leaves`` verified
        beside the first draft: each adds a row to every sequence of the Verify call (the profile's
        Verify time at k + leaves drafts), and a rejected first draft whose target token is one of
        them yields one token more."""
        times = self.times
        tokens = expected_tokens(acceptance, k)
        step = times.step_ms(batch_size, k)
        if leaves:
            tokens += (1.0 - acceptance[0]) * self.leaf_ranks.hit_rate(leaves)
            step += times.target_ms(batch_size, k + leaves) - times.target_ms(batch_size, k)
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
            priced = self._priced.get(batch_size)
            if not self.live_times or priced is None or self.timed_steps - priced[0] >= self.reprice_every:
                priced = self._priced[batch_size] = (self.timed_steps, self._best(batch_size, self.acceptance.rates))
            choice = priced[1]
            if choice[0] == 0 and self.idle_steps >= self.probe_every:
                # a probe (0 where drafting never pays)
                choice = self._best(batch_size, profile.acceptance_by_position)
            elif self.live_times:
                probe = self._live_probe(batch_size, choice)
                if probe is not None:
                    choice = (probe, 0)
            self._chosen[batch_size] = choice
        return self._chosen[batch_size]

    def probing(self, batch_size: int) -> bool:
        """Whether this step's k at ``batch_size`` is a probe (a step run to measure a k, or to see
        whether drafting pays again), not the best priced (``_priced`` holds it while ``_chosen`` does)."""
        return self._choice(batch_size) != self._priced[batch_size][1]

    def _worth_probing(self, batch_size: int, choice: tuple[int, int], ks) -> list[int]:
        """Of ``ks`` (the chosen k aside), smallest first, those a probe may run: a k priced within
        ``probe_within`` of the best (a probe of a far costlier k loses served throughput for what
        it teaches: docs/decisions/goodput-live.md), and k = 0 whatever its price: its step is the
        cheapest there is, and the one speculation has to beat (a price of it from a profile or a
        seed is otherwise never corrected once a drafting k is best)."""
        rates = self.acceptance.rates
        floor = self.probe_within * self.goodput(batch_size, choice[0], rates, choice[1])
        return [k for k in sorted(set(ks) - {choice[0]}) if k == 0 or self.goodput(batch_size, k, rates) >= floor]

    def _live_probe(self, batch_size: int, choice: tuple[int, int]) -> int | None:
        """``goodput:live``'s probe this step, if any: a neighbour of the best k, or k = 0, worth
        probing (``_worth_probing``), for the live step times. One step in ``probe_every`` probes
        the one measured least; while one is not yet trusted, the last ``trusted`` steps of every
        ``probe_every`` (at most half) probe it back to back, so that a profile measured on a
        faster or slower machine (or in another spell of this one) is corrected within a few
        windows, not the hundreds of steps one probe a window takes."""
        most, times = min(self._profile.max_k, self.max_k), self.times
        position = self.timed_steps % self.probe_every
        back_to_back = self.probe_every - min(times.trusted, self.probe_every // 2)  # where a window's probes start
        if position < back_to_back:
            return None
        neighbours = self._worth_probing(batch_size, choice,
                                         [k for k in (0, choice[0] - 1, choice[0] + 1) if 0 <= k <= most])
        untrusted = [k for k in neighbours if times.measured(batch_size, k) < times.trusted]
        if untrusted:
            # the one nearest trusted first (back-to-back probes finish it), then the smaller k
            return min(untrusted, key=lambda k: (-times.measured(batch_size, k), k))
        if neighbours and position == self.probe_every - 1:
            return min(neighbours, key=lambda k: times.measured(batch_size, k))
        return None

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

    def observe_times(self, times: StepTimes) -> None:
        self._sync()
        if self.live_times:
            self.times.observe(times)
            self.timed_steps += 1
            self._chosen.clear()

    def describe(self) -> str:
        return "goodput:live" if self.live_times else "goodput"


class PerReplica:
    """One policy per target replica, each pricing its own replica's steps: a fleet that mixes
    GPU types, or CPU hosts of different widths, is fitted by no single table. ``make(replica)``
    builds a replica's policy when its requests first step; k is then chosen for that replica's
    share of the batch (coordinator/step.py). ``chosen`` holds each replica's last k."""

    def __init__(self, make):
        self.make = make
        self.policies: dict = {}  # Replica (None: requests not placed) -> policy
        self.chosen: dict = {}  # Replica -> the k its last step chose

    def of(self, replica):
        if replica not in self.policies:
            self.policies[replica] = self.make(replica)
        return self.policies[replica]

    def first(self):
        """The first replica's policy (what Info and the metrics name), built if need be."""
        return self.of(next(iter(self.policies), None))

    def describe(self) -> str:
        return self.first().describe()  # (learn: always per replica)
