"""What a decode step took, and the step times ``goodput:live`` prices by (coordinator/policy.py):
the profile's, corrected by the steps served since."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


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
        self._sizes: dict[float, int] = {}  # batch size -> the profiled size nearest it

    def _size(self, batch_size: float) -> int:
        """The profiled batch size nearest ``batch_size`` (by ratio: 3 is nearer 4 than 2); asked
        dozens of times a step, so kept once found."""
        size = self._sizes.get(batch_size)
        if size is None:
            size = self._sizes[batch_size] = min(self.profile.batch_sizes,
                                                 key=lambda b: (abs(math.log(b / max(batch_size, 1.0))), b))
        return size

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
