"""The k policy: how many tokens the draft proposes per sequence at a step, given the live batch size.

``fixed:K``  always K.
``profile``  the paper's method (arXiv 2310.18813): the profile's best k for the live batch size,
             interpolated between the profiled sizes.
``goodput``  beyond the paper: the k in 0 … max_k that maximises expected tokens per second,
             batch × E[tokens per sequence | k] / step_ms(batch, k), with the step times from the
             profile and the acceptance per draft position measured live (a moving average that
             starts from the profile's). k = 0 wins when speculation does not pay: when drafts
             are rarely accepted, or when verifying more tokens costs too much at this batch size.
             ``goodput:live`` measures the step times live too (``LiveStepTimes``).

The scheduler asks ``k_for(batch_size)`` at each step and reports what happened with
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

import math
import statistics
from collections import deque
from dataclasses import dataclass

from specbatch.protocol.profile import expected_tokens
from specbatch.protocol.speculation import tally_positions

from .profile_file import ProfileFile


@dataclass(frozen=True)
class StepTimes:
    """What one step took, for the policies that learn step times (``LiveStepTimes``)."""

    batch_size: int  # sequences stepped
    draft_rows: int  # of those, the ones the draft drafted for (not found by lookup)
    draft_k: int  # the most tokens asked of the draft (its call runs them all): 0 without a Propose
    verify_k: int  # the most drafts and leaves a sequence of the Verify carried
    draft_ms: float  # the Propose calls, wall (the choices before them are the step's own work)
    target_ms: float  # the Verify calls, wall
    step_ms: float  # the whole step, wall
    draft_read: int = 0  # the most tokens a drafting sequence read before drafting (what it had not cached)

    @property
    def caught_up(self) -> bool:
        """Whether the draft first caught up on many tokens served without it (after steps at
        k = 0): its time then says what that cost, not what drafting k costs."""
        return self.draft_read > 2 * self.draft_k + 2


class AllLeaves:
    """Policies that verify every leaf they are offered and learn nothing from them, nor from
    step times."""

    def leaves_for(self, batch_size: int, k: int, most: int) -> int:
        return most

    def observe_first_rejections(self, ranks: list[int | None]) -> None:
        pass

    def observe_times(self, times: StepTimes) -> None:
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


class LiveStepTimes:
    """Step times as steps take them now: the profile's, corrected by what steps took since.

    A profile is measured once, and the parts of a step drift from it (the engine changes, a
    neighbour takes the cores, another machine), so ``goodput`` over a stale profile drafts more
    or less than pays (docs/decisions/goodput-live.md). The Propose and the Verify each keep the last ``window``
    ratios measured / profiled per (profiled batch size nearest the step's, k), and a k measured
    ``trusted`` times or more is priced by their median: single steps on a busy machine stray by
    half their time (a prefill beside them, the other service's threads), and a mean of the few
    steps a rarely run k gets would follow them. A k not measured so at that size is priced from
    the two trusted k nearest it: linear in k through them, for a k next to a trusted one
    (further, the profile's shape at the nearer one's ratio; with one trusted k, its ratio; with
    none, the profile's time). So where
    verifying a row costs less than profiled, the k above those measured gets cheaper too, and
    ``Goodput``'s probes of neighbouring ks walk the measurements there one k at a time. What
    lies outside the two calls (the coordinator's work) is the median of its own window, per size
    and per whether the step asked the draft. A measurement older than ``horizon`` steps does not
    price: a machine's speed moves by 2x between spells, and a k served only as a probe (k = 0
    while drafting pays) would otherwise keep the last spell's price for hundreds of steps after
    the one served has moved; priced from the ks measured since instead, it follows them. It still
    counts as measured (``measured``), so it is not probed back to back again: that churn cost
    more served than it taught. It answers the questions ``Profile`` answers that ``Goodput``
    asks."""

    def __init__(self, profile, window: int = 32, trusted: int = 4, horizon: int = 128):
        self.profile, self.window, self.trusted, self.horizon = profile, window, trusted, horizon
        self.steps = 0  # steps observed: what a measurement's age is counted in
        self.ratios: dict[tuple[str, int], dict[int, deque]] = {}  # (part, size) -> {k: measured / profiled}
        # (size, whether the draft was asked) -> ms outside the two calls: asking it is one more
        # call, which a k = 0 step does not make (one window for both priced each as the k served).
        self.rest: dict[tuple[int, bool], deque] = {}
        self._priced: dict[tuple, float] = {}  # what was asked since the last step
        self._medians: dict[tuple[str, int], dict[int, float]] = {}  # (part, size) -> trusted ratios, this step

    def _size(self, batch_size: float) -> int:
        """The profiled batch size nearest ``batch_size`` (by ratio: 3 is nearer 4 than 2)."""
        return min(self.profile.batch_sizes, key=lambda b: (abs(math.log(b / max(batch_size, 1.0))), b))

    def _record(self, table: dict, key, value: float) -> None:
        table.setdefault(key, deque(maxlen=self.window)).append((self.steps, value))

    def _fresh(self, window) -> list[float]:
        """A window's measurements of the last ``horizon`` steps."""
        return [value for taken, value in window if taken > self.steps - self.horizon]

    def _rest_ms(self, size: int, drafting: bool) -> float:
        """What a step at ``size`` that asks the draft (or not) takes outside its two calls:
        measured, else the profile's (at k = 1, or 0)."""
        key = ("rest", size, drafting)
        if key not in self._priced:
            rest, p = self._fresh(self.rest.get((size, drafting), ())), self.profile
            k = 1 if drafting and p.max_k >= 1 else 0
            self._priced[key] = (statistics.median(rest) if len(rest) >= self.trusted
                                 else max(0.0, p.step_ms(size, k) - p.draft_ms(size, k) - p.target_ms(size, k)))
        return self._priced[key]

    def observe(self, t: StepTimes) -> None:
        p = self.profile
        self.steps += 1
        self._priced.clear()
        self._medians.clear()
        if not t.batch_size or max(t.draft_k, t.verify_k) > p.max_k:
            return  # no profiled time to compare it with
        size = self._size(t.batch_size)
        if t.draft_k and t.draft_rows and not t.caught_up:
            self._record(self.ratios.setdefault(("draft", self._size(t.draft_rows)), {}), t.draft_k,
                         t.draft_ms / p.draft_ms(t.draft_rows, t.draft_k))
        self._record(self.ratios.setdefault(("target", size), {}), t.verify_k,
                     t.target_ms / p.target_ms(t.batch_size, t.verify_k))
        asked = bool(t.draft_k and t.draft_rows)
        self._record(self.rest, (size, asked), max(0.0, t.step_ms - t.draft_ms - t.target_ms))

    def measured(self, batch_size: float, k: int) -> int:
        """Steps of the last window measured at the size nearest ``batch_size`` verifying k drafts
        a sequence (however old)."""
        return len(self.ratios.get(("target", self._size(batch_size)), {}).get(k, ()))

    def _trusted(self, part: str, size: int) -> dict[int, float]:
        """{k: median ratio} of the ks measured ``trusted`` times or more at ``size``: computed once
        a step (a choice prices every k and leaf count in turn)."""
        key = (part, size)
        if key not in self._medians:
            fresh = {m: self._fresh(window) for m, window in self.ratios.get(key, {}).items()}
            self._medians[key] = {m: statistics.median(values) for m, values in fresh.items()
                                  if len(values) >= self.trusted}
        return self._medians[key]

    def _part_ms(self, part: str, profiled, batch_size: float, k: int) -> float:
        """One part's time at (batch_size, k); ``profiled(batch_size, k)``: the profile's."""
        measured = self._trusted(part, self._size(batch_size))
        if k in measured or len(measured) < 2:
            nearest = min(measured, key=lambda m: (abs(m - k), m)) if measured else k
            return profiled(batch_size, k) * measured.get(nearest, 1.0)
        near, far = sorted(measured, key=lambda m: (abs(m - k), m))[:2]
        at_near, at_far = (profiled(batch_size, m) * measured[m] for m in (near, far))
        if abs(k - near) == 1:
            # Next to a trusted k: the measured time per k, straight on. Not the profile's step
            # from near to k scaled by the measured over the profiled step between the trusted ks:
            # a profile's single steps stray, and a small profiled step under a large measured one
            # made a tenfold scale, which priced the next k out of reach of its probes.
            return max(0.0, at_near + (at_near - at_far) / (near - far) * (k - near))
        # Further: the profile's shape at the measured level (a call past 12 rows, say, costs
        # another block of weights).
        return max(0.0, at_near + measured[near] * (profiled(batch_size, k) - profiled(batch_size, near)))

    def target_ms(self, batch_size: float, k: int) -> float:
        key = ("target", batch_size, k)
        if key not in self._priced:  # a choice asks each (k, leaves) in turn: priced once a step
            self._priced[key] = self._part_ms("target", self.profile.target_ms, batch_size, k)
        return self._priced[key]

    def step_ms(self, batch_size: float, k: int) -> float:
        key = ("step", batch_size, k)
        if key not in self._priced:
            draft = self._part_ms("draft", self.profile.draft_ms, batch_size, k) if k else 0.0
            self._priced[key] = draft + self.target_ms(batch_size, k) + self._rest_ms(self._size(batch_size), k > 0)
        return self._priced[key]


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
        self._sync()

    def _sync(self):
        profile = self.profile_file.profile
        if profile is not self._profile:  # at start, or the file was reloaded
            self._profile = profile
            self.acceptance = LiveAcceptance(profile.acceptance_by_position[: self.max_k], self.half_life)
            self.times = LiveStepTimes(profile) if self.live_times else profile
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
            choice = self._best(batch_size, self.acceptance.rates)
            if choice[0] == 0 and self.idle_steps >= self.probe_every:
                # a probe (0 where drafting never pays)
                choice = self._best(batch_size, profile.acceptance_by_position)
            elif self.live_times:
                probe = self._live_probe(batch_size, choice)
                if probe is not None:
                    choice = (probe, 0)
            self._chosen[batch_size] = choice
        return self._chosen[batch_size]

    def _live_probe(self, batch_size: int, choice: tuple[int, int]) -> int | None:
        """``goodput:live``'s probe this step, if any: a neighbour of the best k, or k = 0, for the
        live step times. A neighbour only where it is priced near the best (a probe of a far
        costlier k loses served throughput for what it teaches: docs/decisions/goodput-live.md);
        k = 0 always: its step is the cheapest there is, and the one speculation has to beat.
        One step in ``probe_every`` probes the one measured least; while one is not yet trusted,
        the last ``trusted`` steps of every ``probe_every`` (at most half) probe it back to back, so that a
        profile measured on a faster or slower machine (or in another spell of this one) is
        corrected within a few windows, not the hundreds of steps one probe a window takes."""
        most, rates, times = min(self._profile.max_k, self.max_k), self.acceptance.rates, self.times
        floor = self.probe_within * self.goodput(batch_size, choice[0], rates, choice[1])
        neighbours = [k for k in sorted({0, choice[0] - 1, choice[0] + 1} - {choice[0]})
                      if 0 <= k <= most and (k == 0 or self.goodput(batch_size, k, rates) >= floor)]
        position = self.timed_steps % self.probe_every
        untrusted = [k for k in neighbours if times.measured(batch_size, k) < times.trusted]
        if untrusted and position >= self.probe_every - min(times.trusted, self.probe_every // 2):
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
